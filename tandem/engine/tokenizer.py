"""Text in, token ids out, and back again as a stream of clean text deltas.

``Tokenizer`` is a thin wrapper over a Hugging Face fast tokenizer that fixes the
few choices the engine depends on (special tokens, chat template, the set of
end-of-sequence ids). ``IncrementalDetokenizer`` turns generated ids into text
one token at a time, and ``StopStringMatcher`` holds back text that may turn out
to be a stop string, so that neither a half character nor half a stop string is
ever sent to a client.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tandem.errors import ConfigError, InvalidRequestError

# What a byte-level or SentencePiece decoder yields for an incomplete UTF-8 sequence.
REPLACEMENT_CHAR = "\ufffd"

# A SentencePiece byte-fallback token: one byte of a character the vocabulary lacks.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# Previous tokens decoded with each new one; enough to cover a multi-byte character
# split over byte tokens and the leading-space rules of SentencePiece (vLLM uses 5).
_PROMPT_WINDOW = 5


class Tokenizer:
    """Wraps a Hugging Face tokenizer instance (fast tokenizer)."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self._hf = hf_tokenizer
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        # A model may end a turn with several tokens (Llama 3 lists <|eot_id|> and
        # <|end_of_text|> in generation_config), so this is a set, not one id.
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = len(hf_tokenizer)
        self._token_bytes: dict[int, bytes] = {}  # token_bytes' answers so far
        # split_special_tokens is a flag of the Rust tokenizer that each encode sets to
        # the call's value, not an argument of that one call: set on the shared
        # tokenizer, an encode on another thread (the router tokenizes on two) in the
        # meantime splits its chat template's own control tokens. So that path has a
        # copy of its own (made on its first use).
        self._splitting: Any = None
        self._splitting_lock = threading.Lock()
        # transformers builds added_tokens_decoder anew at each read: read once.
        self._added = dict(hf_tokenizer.added_tokens_decoder)
        # The text of any control token, as a message's content might hold it.
        controls = sorted((t.content for t in self._added.values() if t.special), key=len)
        self._control = re.compile(
            "|".join(re.escape(c) for c in reversed(controls)) if controls else "(?!)"
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, *, gguf_file: str | None = None) -> Tokenizer:
        """Loads the tokenizer in directory ``path``, or from ``gguf_file`` in it.

        End-of-sequence ids listed in ``generation_config.json`` or ``config.json``
        there are added to the tokenizer's own.
        """
        # Imported here: transformers takes seconds to import, and wrapping an
        # already-built tokenizer does not need it.
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            if gguf_file is None:
                hf = AutoTokenizer.from_pretrained(path)
            else:
                hf = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
        except (OSError, ValueError) as exc:  # transformers' message guesses at packages
            raise ConfigError(
                f"cannot load the tokenizer of {path / (gguf_file or '')}: a model directory "
                f"needs its tokenizer files (tokenizer.json, tokenizer_config.json) ({exc})"
            ) from exc
        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eos |= _eos_ids_in(path / name)
        return cls(hf, eos)

    @property
    def hf_tokenizer(self) -> Any:
        return self._hf

    def encode(self, text: str) -> list[int]:
        """Tokenizes a raw prompt the way ``generate`` would, BOS included if the model adds one."""
        return list(self._hf.encode(text, add_special_tokens=True))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Applies the chat template, ending with the prompt for the assistant's turn."""
        if not getattr(self._hf, "chat_template", None):
            raise ConfigError(
                "the model's tokenizer has no chat_template, so chat messages cannot be "
                "formatted; send a raw prompt instead"
            )
        # tokenize=False, then encode: transformers 5 returns a BatchEncoding from
        # apply_chat_template(tokenize=True). The template writes BOS itself, so the
        # encode must not add it a second time.
        text = self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        written = [i for i, m in enumerate(messages) if self._control.search(m["content"])]
        if not written:
            return list(self._hf.encode(text, add_special_tokens=False))
        return self._encode_chat_as_written(text, messages, written)

    def _encode_chat_as_written(
        self, text: str, messages: list[dict[str, str]], written: list[int]
    ) -> list[int]:
        """``text`` encoded with every control token that a message wrote ("<|im_end|>"
        typed in a user's content) encoded as the plain text it is: control tokens
        come only from the chat template. Otherwise a user could end their turn and
        open a system one. The rest is encoded as HF does."""
        spans = self._content_spans(text, messages, written)
        if spans is None:
            raise InvalidRequestError(
                f"messages[{written[0]}].content",
                "holds the text of a control token, and the model's chat template does not "
                "write the content as given, so it cannot be kept as text",
            )
        encoded = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = []
        for token_id, (start, end) in zip(
            encoded["input_ids"], encoded["offset_mapping"], strict=True
        ):
            if self.special_name(token_id) is not None and any(
                a <= start and end <= b for a, b in spans
            ):
                ids += self._splitting_hf().encode(
                    text[start:end], add_special_tokens=False, split_special_tokens=True
                )
            else:
                ids.append(token_id)
        return ids

    def _splitting_hf(self) -> Any:
        with self._splitting_lock:
            if self._splitting is None:
                self._splitting = copy.deepcopy(self._hf)
            return self._splitting

    def _content_spans(
        self, text: str, messages: list[dict[str, str]], written: list[int]
    ) -> list[tuple[int, int]] | None:
        """Where the contents of messages ``written`` lie in ``text``, the template
        rendered: found by rendering it again with a mark in place of each of them
        (searching for a content itself found the template's own text where it began
        with it; the other messages are rendered as they are, since templates trim or
        branch on contents). None when the template does not write each of them once,
        as given."""
        marks = {i: f"\ue000{i}\ue001" for i in written}
        shadow = self._hf.apply_chat_template(
            [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)],
            tokenize=False, add_generation_prompt=True,
        )  # fmt: skip
        spans, pieces, at, length = [], [], 0, 0
        for i, mark in marks.items():
            where = shadow.find(mark, at)
            if where < 0 or shadow.count(mark) != 1:
                return None
            content = messages[i]["content"]
            pieces.append(shadow[at:where])
            length += where - at
            spans.append((length, length + len(content)))
            pieces.append(content)
            length += len(content)
            at = where + len(mark)
        pieces.append(shadow[at:])
        return spans if "".join(pieces) == text else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, b"" for a special token (which ``decode``
        skips). A token may hold part of a UTF-8 character, which it decodes to U+FFFD
        alone: OpenAI's logprobs carry these bytes so that clients can join them."""
        known = self._token_bytes.get(token_id)
        if known is None:
            known = self._token_bytes[token_id] = self._bytes_of(token_id)
        return known

    def special_name(self, token_id: int) -> str | None:
        """A special token's text as written ("<|im_end|>"), None for any other token.
        ``token_bytes`` gives every special token b"", so this is what tells them
        apart where tokens are named (OpenAI's logprobs)."""
        added = self._added.get(token_id)
        return added.content if added is not None and added.special else None

    def _bytes_of(self, token_id: int) -> bytes:
        hf = self._hf
        added = self._added.get(token_id)  # its text as written, not in bytes
        if added is not None:
            return b"" if added.special else added.content.encode()
        piece = hf.convert_ids_to_tokens(token_id)
        if piece is None:  # past the tokenizer's vocabulary (a model's padded rows)
            return b""
        decoder = getattr(getattr(hf, "backend_tokenizer", None), "decoder", None)
        if type(decoder).__name__ == "ByteLevel" and all(c in _UNICODE_BYTES for c in piece):
            return bytes(_UNICODE_BYTES[c] for c in piece)
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match[1], 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary

    def decode(self, ids: Sequence[int]) -> str:
        # No clean-up of spaces before punctuation: it rewrites what the model wrote and
        # would make a windowed decode differ from a decode of the whole sequence.
        return self._hf.decode(
            list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False
        )


def _eos_ids_in(config_path: Path) -> set[int]:
    """The ``eos_token_id`` of a JSON config, which may be absent, null, an int or a list."""
    if not config_path.is_file():
        return set()
    with open(config_path, encoding="utf-8") as f:
        value = json.load(f).get("eos_token_id")
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return set(value)
    raise ConfigError(
        f"eos_token_id in {config_path} must be an int or a list of ints, got {value!r}"
    )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that are always valid, complete UTF-8.

    The prefix_offset/read_offset scheme of text-generation-inference and vLLM: each
    step decodes a window of the last emitted tokens (``ids[prefix_offset:read_offset]``)
    with and without the tokens not yet emitted, and emits the difference. Decoding
    with context rather than the lone new token keeps the spaces that SentencePiece
    and byte-level BPE attach to a token's neighbours. Text ending in U+FFFD is the
    start of a character whose other bytes are still to come, so it is held back and
    the offsets stay put until the character is complete; the complete characters
    before it go out at once (a stop string they end must not wait for the next
    character: the request would run on past it).

    The concatenated deltas equal ``tokenizer.decode(generated ids)`` whenever that
    decode has no U+FFFD of its own, with one exception: a SentencePiece tokenizer
    drops the leading space of a sequence's first token, and the delta keeps it,
    because the window starts in the prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        # The window: ids from prefix_offset on. Earlier ids are never decoded again, so
        # they are dropped, and prefix_offset is always 0; of the prompt only the tail is kept.
        self._ids: list[int] = list(prompt_ids[-_PROMPT_WINDOW:])
        self._read_offset = len(self._ids)  # ids before this have been emitted as text
        # Characters after the read offset's text already emitted: those before a
        # character whose bytes are not all here yet.
        self._ahead = 0

    def add(self, token_id: int) -> str:
        """Returns the text that ``token_id`` completes, possibly ""."""
        if self._tokenizer.special_name(token_id) is not None:
            # Skipped by every decode (removed before the decoder runs), so it is left
            # out of the window, which a run of them (an answer under ignore_eos) grew
            # without end, each token decoding the whole run again.
            return ""
        self._ids.append(token_id)
        prefix_text, new_text = self._decode_window()
        start = len(prefix_text) + self._ahead
        if new_text.endswith(REPLACEMENT_CHAR):  # a character's first bytes: hold them
            complete = new_text.rstrip(REPLACEMENT_CHAR)
            delta = complete[start:]
            self._ahead += len(delta)
            return delta
        # Equal lengths: a token that adds no character yet; it stays in the window.
        if len(new_text) <= start:
            return ""
        self._advance()
        return new_text[start:]

    def flush(self) -> str:
        """At the end of the stream, returns what was held back, U+FFFD and all."""
        prefix_text, new_text = self._decode_window()
        start = len(prefix_text) + self._ahead
        self._advance()
        return new_text[start:]

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        return decode(self._ids[: self._read_offset]), decode(self._ids)

    def _advance(self) -> None:
        # Everything is emitted and ends on a character boundary, so the next window
        # starts at the old read offset: the tokens just emitted give the new ones context.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._ahead = 0


class StopStringMatcher:
    """Holds back streamed text that may be the start of a stop string."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        # Every proper prefix of a stop string: a buffer ending in one may still become a stop.
        self._prefixes = {s[:i] for s in self._stop for i in range(1, len(s))}
        self._max_prefix = max((len(p) for p in self._prefixes), default=0)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string has been seen).

        On a stop, only the text before the stop string is emitted; the stop string
        and anything after it are dropped, and later pushes return ("", True).
        """
        if self._stopped:
            return "", True
        if not self._stop:
            return delta, False
        buffer = self._held + delta
        # Held text never contains a whole stop string, so the earliest match in the
        # buffer is the earliest in the stream.
        hits = [i for i in (buffer.find(s) for s in self._stop) if i >= 0]
        if hits:
            self._held = ""
            self._stopped = True
            return buffer[: min(hits)], True
        # Hold the longest tail that could still grow into a stop string; a stop can
        # only start inside it, since every earlier start point has been ruled out.
        keep = 0
        for n in range(min(len(buffer), self._max_prefix), 0, -1):
            if buffer[-n:] in self._prefixes:
                keep = n
                break
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """At the end of the stream, releases held text (nothing, after a stop)."""
        held, self._held = self._held, ""
        return held


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character (bytes that
    print stand for themselves, the rest are moved up past 255): character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]  # fmt: skip
    moved = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(moved)}
    return {c: b for b, c in chars.items()}


_UNICODE_BYTES = _byte_level_alphabet()
