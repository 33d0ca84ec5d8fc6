"""What the load sends: a list of ``RequestSpec`` (input, expected input tokens, output tokens).

Three sources:
- **synthetic**: random English words, with input and output lengths drawn from a
  ``LengthDist`` (fixed, uniform range or normal). Input lengths are exact in the
  server's own tokens: each word's token cost is measured once through the API's
  ``Tokenize`` call, prompts are composed to the target count, and every prompt's
  count is checked with ``Tokenize`` again (the checked count is what is recorded).
  Prompts are sent as plain text (no chat template) and differ from the first word,
  so the prefix cache does not flatter the result.
- **jsonl**: one object per line, ``{"prompt": "..."}`` (plain text) or
  ``{"messages": [{"role": ..., "content": ...}]}`` (chat), with an optional
  ``"output_len"``.
- **sharegpt**: a JSON list of ``{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]}`` (``role``/``content`` keys also accepted):
  the first human turn is the prompt (sent as a chat message) and the token count of
  the reply that follows it is the output length, as vLLM's benchmark does. With
  ``--multi-turn``, every human turn of a conversation is a request carrying the
  turns before it (``sharegpt_chats``), sent as the runner sends follow-ups.

Output lengths are enforced with ``max_tokens`` and ``ignore_eos``, so a request
generates exactly ``output_len`` tokens unless it fails. Everything random comes
from one seed.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tandem.errors import InvalidRequestError

T = TypeVar("T")

# Counts the tokens of a plain-text prompt (``prompt=``) or a chat (``messages=``)
# exactly as the server would; the runner binds it to the Tokenize RPC.
TokenCounter = Callable[..., Awaitable[int]]

# Common words; most are one token in any English BPE vocabulary.
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her "
    "would make like him into time has look two more write go see number no way could people "
    "my than first water been call who oil its now find long down day did get come made may "
    "part over new sound take only little work know place year live me back give most very"
).split()

# vLLM's ShareGPT filter: conversations this short say nothing about a server.
MIN_SHAREGPT_TOKENS = 4


@dataclass(frozen=True)
class RequestSpec:
    prompt: str | None = None  # plain text, or
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs for a chat
    input_len: int | None = None  # prompt tokens as the server counts them, if known
    output_len: int = 128  # max_tokens; with ignore_eos, the tokens generated

    def input_kwargs(self) -> dict:
        if self.messages is not None:
            return {"messages": [{"role": r, "content": c} for r, c in self.messages]}
        return {"prompt": self.prompt}


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, parsed from ``128``, ``fixed:128``,
    ``uniform:64-256`` (inclusive) or ``normal:128,32`` (mean, std; rounded, >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str, flag: str) -> LengthDist:
        kind, _, rest = spec.partition(":") if ":" in spec else ("fixed", "", spec)
        try:
            if kind == "fixed":
                dist = cls("fixed", int(rest))
            elif kind == "uniform":
                lo, hi = rest.split("-")
                dist = cls("uniform", int(lo), int(hi))
            elif kind == "normal":
                mean, std = rest.split(",")
                dist = cls("normal", float(mean), float(std))
            else:
                raise ValueError(kind)
        except ValueError:
            raise InvalidRequestError(
                flag,
                f"{flag} must be N, fixed:N, uniform:LO-HI or normal:MEAN,STD; got {spec!r}",
            ) from None
        dist._check(flag)
        return dist

    def _check(self, flag: str) -> None:
        if not (math.isfinite(self.a) and self.a >= 1) or (
            self.kind == "uniform" and self.b < self.a
        ):
            raise InvalidRequestError(
                flag, f"{flag} lengths must be >= 1 (and LO <= HI), got {self.describe()}"
            )
        if self.kind == "normal" and not (self.b >= 0 and math.isfinite(self.b)):
            raise InvalidRequestError(flag, f"{flag} std must be >= 0, got {self.b}")

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.kind == "fixed":
            values = np.full(n, self.a)
        elif self.kind == "uniform":
            values = rng.integers(int(self.a), int(self.b), size=n, endpoint=True)
        else:
            values = np.rint(rng.normal(self.a, self.b, size=n))
        return [max(1, int(v)) for v in values]

    @property
    def upper(self) -> int:
        """The longest length to check against the context up front: exact for fixed and
        uniform; mean + 4 std for normal, which a sample may still exceed (every request
        is checked again once its prompt is counted)."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(self.b)
        return int(self.a + 4 * self.b)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform {int(self.a)}-{int(self.b)}"
        return f"normal mean {self.a:g} std {self.b:g}"


async def synthetic(
    n: int, input_len: LengthDist, output_len: LengthDist, seed: int, count: TokenCounter
) -> list[RequestSpec]:
    source = await SyntheticSource.calibrate(input_len, output_len, seed, count)
    return await count_inputs(source.more(n), count)


class SyntheticSource:
    """Synthetic requests from one seeded generator, as many as asked, with no call to
    the server once calibrated: a duration-bounded run draws new ones as it goes
    rather than send the same prompts again (which a prefix cache would serve from
    memory). Their ``input_len`` is the composer's count, which the server's usage
    confirms."""

    def __init__(self, composer: PromptComposer, input_len: LengthDist,
                 output_len: LengthDist, seed: int) -> None:  # fmt: skip
        self.composer = composer
        self.input_len, self.output_len = input_len, output_len
        self.rng = np.random.default_rng(seed)

    @classmethod
    async def calibrate(
        cls, input_len: LengthDist, output_len: LengthDist, seed: int, count: TokenCounter
    ) -> SyntheticSource:
        return cls(await PromptComposer.calibrate(count), input_len, output_len, seed)

    def more(self, n: int) -> list[RequestSpec]:
        inputs = self.input_len.sample(n, self.rng)
        outputs = self.output_len.sample(n, self.rng)
        specs = []
        for k, o in zip(inputs, outputs, strict=True):
            prompt, tokens = self.composer.compose(k, self.rng)
            specs.append(RequestSpec(prompt=prompt, input_len=tokens, output_len=int(o)))
        return specs


class PromptComposer:
    """Builds plain-text prompts of an exact token count from words of known cost.

    Byte-level BPE tokenizers split text into words before merging, so the tokens of
    " w1 w2 ..." are ``base`` (special tokens the tokenizer adds) plus each " w"'s cost.
    """

    def __init__(self, base: int, costs: dict[str, int]) -> None:
        self.base = base
        self.costs = costs
        self.by_cost: dict[int, list[str]] = {}
        for w, c in costs.items():
            self.by_cost.setdefault(c, []).append(w)
        self._ok = [True]  # _ok[r]: some words cost exactly r tokens in all

    @classmethod
    async def calibrate(cls, count: TokenCounter, words: Sequence[str] = WORDS) -> PromptComposer:
        singles = await _gather_limited([count(prompt=f" {w}") for w in words])
        doubles = await _gather_limited([count(prompt=f" {w} {w}") for w in words])
        costs = {w: d - s for w, s, d in zip(words, singles, doubles, strict=True)}
        bases = [s - costs[w] for w, s in zip(words, singles, strict=True)]
        costs = {w: c for w, c in costs.items() if c >= 1}
        if not costs:
            raise InvalidRequestError(
                "dataset",
                "cannot compose synthetic prompts: no word has a positive token cost "
                "under the server's tokenizer",
            )
        return cls(min(bases), costs)

    def compose(self, tokens: int, rng: np.random.Generator) -> tuple[str, int]:
        """A prompt of ``tokens`` tokens (the nearest reachable count below, if not
        exact), and its count."""
        target = max(0, tokens - self.base)
        reachable = self._reachable(target)
        while not reachable[target] and target > 0:
            target -= 1
        words: list[str] = []
        left = target
        while left > 0:
            options = [c for c in self.by_cost if c <= left and reachable[left - c]]
            cost = options[int(rng.integers(len(options)))]
            # Most words cost one token; draw the cost first so long words are not favoured.
            pool = self.by_cost[cost]
            words.append(pool[int(rng.integers(len(pool)))])
            left -= cost
        if not words:  # the server refuses empty prompts
            words.append(min(self.costs, key=self.costs.get))
            target = self.costs[words[0]]
        return "".join(" " + w for w in words), self.base + target

    def _reachable(self, target: int) -> list[bool]:
        ok = self._ok
        for r in range(len(ok), target + 1):
            ok.append(any(c <= r and ok[r - c] for c in self.by_cost))
        return ok


def load_jsonl(path: str | Path, default_output_len: int) -> list[RequestSpec]:
    specs = []
    # Lines end at LF (CRLF too: JSON ignores the CR), not at what str.splitlines()
    # also splits at (U+2028, U+0085...), which JSON may hold unescaped inside a string.
    for lineno, line in enumerate(_read(path).split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError("dataset", f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise InvalidRequestError("dataset", f"{where}: expected an object")
        output_len = obj.get("output_len", default_output_len)
        if not isinstance(output_len, int) or output_len < 1:
            raise InvalidRequestError(
                "dataset", f"{where}: output_len must be an integer >= 1, got {output_len!r}"
            )
        if isinstance(obj.get("prompt"), str) and obj["prompt"]:
            specs.append(RequestSpec(prompt=obj["prompt"], output_len=output_len))
        elif isinstance(obj.get("messages"), list) and obj["messages"]:
            try:
                messages = tuple((m["role"], m["content"]) for m in obj["messages"])
                if not all(isinstance(x, str) for m in messages for x in m):
                    raise TypeError
            except (KeyError, TypeError):
                raise InvalidRequestError(
                    "dataset", f'{where}: each message needs "role" and "content" strings'
                ) from None
            specs.append(RequestSpec(messages=messages, output_len=output_len))
        else:
            raise InvalidRequestError(
                "dataset", f'{where}: needs a non-empty "prompt" string or "messages" list'
            )
    if not specs:
        raise InvalidRequestError("dataset", f"{path} holds no prompts")
    return specs


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the reply to it) of every conversation that has both."""
    return [chat[0] for chat in load_sharegpt_chats(path)]


def load_sharegpt_chats(path: str | Path) -> list[list[tuple[str, str]]]:
    """Every conversation's (human turn, reply) pairs, from its first human turn that
    has a reply, for as long as human turns and replies alternate; conversations
    without such a pair are left out."""
    try:
        data = json.loads(_read(path))
    except json.JSONDecodeError as exc:
        raise InvalidRequestError("dataset", f"{path}: not JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise InvalidRequestError("dataset", f"{path}: expected a JSON list of conversations")
    chats = []
    for i, conv in enumerate(data):
        turns = None
        if isinstance(conv, dict):
            turns = conv.get("conversations") or conv.get("messages") or []
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise InvalidRequestError(
                "dataset", f"{path}: conversation {i} must be an object whose "
                '"conversations" (or "messages") is a list of objects',
            )  # fmt: skip
        texts = [(t.get("from", t.get("role")), t.get("value", t.get("content"))) for t in turns]
        pairs = [_pair(a, b) for a, b in zip(texts, texts[1:], strict=False)]
        start = next((i for i, pair in enumerate(pairs) if pair), None)
        if start is None:
            continue
        chat = []
        for pair in pairs[start::2]:
            if pair is None:
                break
            chat.append(pair)
        chats.append(chat)
    if not chats:
        raise InvalidRequestError("dataset", f"{path} holds no human turn followed by a reply")
    return chats


def _pair(turn: tuple, next_turn: tuple) -> tuple[str, str] | None:
    """(human text, reply) when ``turn`` is a human's and ``next_turn`` replies to it."""
    (who, text), (who2, reply) = turn, next_turn
    ok = who in ("human", "user") and who2 in ("gpt", "assistant")
    ok = ok and isinstance(text, str) and isinstance(reply, str) and text and reply
    return (text, reply) if ok else None


async def sharegpt(
    pairs: list[tuple[str, str]], context_length: int, count: TokenCounter
) -> list[RequestSpec]:
    """Chat requests whose output length is the reply's token count; too short or too
    long conversations are left out (below 4 tokens, or over the context length)."""
    inputs = await _gather_limited([count(messages=[{"role": "user", "content": p}])
                                    for p, _ in pairs])  # fmt: skip
    outputs = await _gather_limited([count(prompt=r) for _, r in pairs])
    specs = [
        RequestSpec(messages=(("user", p),), input_len=i, output_len=o)
        for (p, _), i, o in zip(pairs, inputs, outputs, strict=True)
        if i >= MIN_SHAREGPT_TOKENS and o >= MIN_SHAREGPT_TOKENS and i + o <= context_length
    ]
    if not specs:
        raise InvalidRequestError("dataset", "no conversation fits: every one is under "
                                  f"{MIN_SHAREGPT_TOKENS} tokens or over the context length "
                                  f"{context_length}")  # fmt: skip
    return specs


async def sharegpt_chats(
    chats: list[list[tuple[str, str]]],
    n: int,
    context_length: int,
    count: TokenCounter,
    output_len: int | None = None,
) -> list[RequestSpec]:
    """Each conversation's turns in order, turn k a chat of the human turns and replies
    before it and its own human turn (the file's replies stand in for the server's,
    which a multi-turn run puts in their place), with the reply's token count as its
    output length, or ``output_len`` for every turn; chats in the given order until
    ``n`` turns are had. A conversation ends before its first turn that is too short
    (as ``sharegpt``) or does not fit the context length, with each earlier reply
    counted at the length the server will give it."""
    specs: list[RequestSpec] = []
    for chat in chats:
        if len(specs) >= n:
            break
        turns = [tuple(x for h, r in chat[:k] for x in (("user", h), ("assistant", r)))
                 + (("user", chat[k][0]),) for k in range(len(chat))]  # fmt: skip
        inputs = await _gather_limited([count(messages=[{"role": r, "content": c} for r, c in t])
                                        for t in turns])  # fmt: skip
        outputs = await _gather_limited([count(prompt=reply) for _, reply in chat])
        longer = 0  # what the server's replies so far add to the file's
        for t, i, o in zip(turns, inputs, outputs, strict=True):
            if i < MIN_SHAREGPT_TOKENS or o < MIN_SHAREGPT_TOKENS:
                break
            sent = output_len or o
            if i + longer + sent > context_length:
                break
            specs.append(RequestSpec(messages=t, input_len=i + longer, output_len=sent))
            longer += sent - o
    if not specs:
        raise InvalidRequestError("dataset", "no conversation fits: every first turn is under "
                                  f"{MIN_SHAREGPT_TOKENS} tokens or over the context length "
                                  f"{context_length}")  # fmt: skip
    return specs


async def count_inputs(specs: list[RequestSpec], count: TokenCounter) -> list[RequestSpec]:
    """The same specs with ``input_len`` filled in by the server's tokenizer."""
    counts = await _gather_limited([count(**s.input_kwargs()) for s in specs])
    return [RequestSpec(s.prompt, s.messages, c, s.output_len)
            for s, c in zip(specs, counts, strict=True)]  # fmt: skip


def pick(specs: list[T], n: int, seed: int, in_order: bool = False) -> list[T]:
    """``n`` specs (or chats) in a seeded random order, or in their own (``in_order``),
    cycling when the file holds fewer."""
    order = range(len(specs)) if in_order else np.random.default_rng(seed).permutation(len(specs))
    return [specs[int(order[i % len(specs)])] for i in range(n)]


def follow_ups(specs: Sequence[RequestSpec]) -> list[tuple[int, int] | None]:
    """For each spec, the conversation turn it continues, for sending with real replies
    (``--multi-turn``): ``(i, p)`` when an earlier spec ``i`` sent exactly the messages
    before this one's message ``p``, an assistant turn, whose content is then to be
    the reply that ``i`` got; the latest such ``i``. None for the rest."""
    sent: dict[tuple[tuple[str, str], ...], int] = {}
    links: list[tuple[int, int] | None] = []
    for j, spec in enumerate(specs):
        messages = spec.messages or ()
        link = None
        for p in range(len(messages) - 1, 0, -1):
            if messages[p][0] == "assistant" and messages[:p] in sent:
                link = sent[messages[:p]], p
                break
        links.append(link)
        if messages:
            sent[messages] = j
    return links


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError("dataset", f"cannot read {path}: {exc.strerror}") from None


async def _gather_limited(coros: list[Coroutine[Any, Any, int]], limit: int = 16) -> list[int]:
    """Their results, ``limit`` at a time; the first failure cancels the rest."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Coroutine[Any, Any, int]) -> int:
        try:
            async with sem:
                return await c
        finally:
            c.close()  # one cancelled before its turn was never awaited: no warning

    tasks = [asyncio.ensure_future(one(c)) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
