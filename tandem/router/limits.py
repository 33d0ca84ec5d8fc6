"""Input limits: what a request may hold, checked before anything costly happens.

Every check here reads lengths and counts only: no tokenizing, no template, no
copy of the input. A request over a limit gets INVALID_ARGUMENT naming the field
and the limit ("prompt must be at most 131072 characters, got 300000"); the
message never echoes the offending text. The defaults (RouterConfig):

    max_prompt_chars    32 x the context length (chat: the contents' total)
    max_chat_messages   2048
    max_stop_strings    16, each at most max_stop_chars (256)
    request_id          at most 200 characters (workers take 256, minus the API key's
                        "<tenant>~" prefix and "/<call>.<attempt>" suffix), ASCII letters, digits
                        and ``._:@+=-``: no "~" or "/", which the router adds to the
                        id on the workers (frontend.PreparedRequest.worker_id), and
                        nothing that could break a log line (newlines, quotes)

The message as a whole is bounded by gRPC (``max_request_bytes``) before any of
this runs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tandem._proto.tandem.v1 import tandem_pb2
from tandem.config import RouterConfig
from tandem.errors import InvalidRequestError

# Workers take ids of up to 256 characters; the router prefixes an API key's 12-hex
# tenant and "~", and appends its call's "/<tag>-<count>" and a migration's ".<n>"
# (relay.py): 13 + 1 + 6 + 1 + 15 + 2, with room to spare.
MAX_REQUEST_ID_CHARS = 200
REQUEST_ID_ALPHABET = "ASCII letters, digits and . _ : @ + = -"
_REQUEST_ID_OUTSIDE = re.compile(r"[^A-Za-z0-9._:@+=-]")
CHARS_PER_CONTEXT_TOKEN = 32  # max_prompt_chars when not set (see RouterConfig)
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class InputLimits:
    max_prompt_chars: int
    max_chat_messages: int = 2048
    max_stop_strings: int = 16
    max_stop_chars: int = 256

    @classmethod
    def from_config(cls, config: RouterConfig, context_length: int) -> InputLimits:
        prompt = config.max_prompt_chars or CHARS_PER_CONTEXT_TOKEN * context_length
        return cls(prompt, config.max_chat_messages, config.max_stop_strings,
                   config.max_stop_chars)  # fmt: skip

    def check_request_id(self, request_id: str) -> None:
        _at_most("request_id", len(request_id), MAX_REQUEST_ID_CHARS, "characters")
        if bad := _REQUEST_ID_OUTSIDE.search(request_id):
            raise InvalidRequestError(
                "request_id",
                f"request_id may hold only {REQUEST_ID_ALPHABET}, got U+{ord(bad[0]):04X} "
                f"at character {bad.start()}",
            )

    def check_stop(self, stop: Sequence[str]) -> None:
        _at_most("stop", len(stop), self.max_stop_strings, "strings")
        for i, s in enumerate(stop):
            _at_most(f"stop[{i}]", len(s), self.max_stop_chars, "characters")

    def check_prompt(self, prompt: str) -> None:
        _at_most("prompt", len(prompt), self.max_prompt_chars, "characters")

    def check_chat(self, chat: tandem_pb2.Chat) -> None:
        """Count, roles, then the contents' total length (emptiness is wire.chat_from_proto's)."""
        messages = chat.messages
        _at_most("chat.messages", len(messages), self.max_chat_messages, "messages")
        total = 0
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                field = f"chat.messages[{i}].role"
                got = repr(m.role) if len(m.role) <= 20 else f"a {len(m.role)}-character string"
                raise InvalidRequestError(
                    field, f"{field} must be one of {', '.join(ROLES)}, got {got}"
                )
            total += len(m.content)
        if total > self.max_prompt_chars:
            raise InvalidRequestError(
                "chat.messages",
                f"chat.messages content must be at most {self.max_prompt_chars} characters "
                f"in all, got {total}",
            )


def _at_most(field: str, n: int, limit: int, unit: str) -> None:
    if n > limit:
        raise InvalidRequestError(field, f"{field} must be at most {limit} {unit}, got {n}")
