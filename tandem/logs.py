"""Process logging: every line about a request carries its id; text or JSON lines.

The gRPC handlers set ``request_id`` (a context variable, so it follows the
handler's task and what it awaits) as soon as they know it; every record logged
there gets it, as `` [request=ID]`` in text and as ``"request_id"`` in JSON.

The format is ``text`` unless the process is started with ``TANDEM_LOG_FORMAT=json``
(``tandem serve --log-format json`` sets it for every process it starts): then
each line is one JSON object (``ts``, ``level``, ``process``, ``logger``,
``request_id`` when there is one, ``message``, ``exception`` with the traceback),
which log shippers read without parsing rules.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Hashable
from contextvars import ContextVar
from datetime import UTC, datetime

from tandem.errors import ConfigError

request_id: ContextVar[str] = ContextVar("tandem_request_id", default="")


_OTHER_KINDS = object()  # where a Throttle's kinds past its bound go


class Throttle:
    """Lines that a flood repeats (a refusal per overloaded request): of each kind (an
    API key and a cause, say), one logged at most every ``every_s``, the next one
    with a count of those left out; ``flush`` logs the counts still held (at stop).
    Called from one thread (the event loop's)."""

    KINDS = 256  # the most kinds remembered; past it, new kinds share one throttle

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger, self.every_s = logger, every_s
        # kind -> [when last logged, lines held since, the last held line]
        self._kinds: dict[Hashable, list] = {}

    def log(self, level: int, message: str, *args, kind: Hashable = None) -> None:
        now = time.monotonic()
        if kind not in self._kinds and len(self._kinds) >= self.KINDS:
            self._forget_quiet(now)
            if len(self._kinds) >= self.KINDS:  # all of them in their window
                kind = _OTHER_KINDS
        state = self._kinds.get(kind)
        if state is not None and now - state[0] < self.every_s:
            state[1] += 1
            state[2] = (level, message, args)
            return
        held = state[1] if state is not None else 0
        if held:
            message += f" (and {held} more like it since the last one logged)"
        self.logger.log(level, message, *args)
        self._kinds[kind] = [now, 0, None]

    def _forget_quiet(self, now: float) -> None:
        """The kinds past their window with nothing held: their next line is logged."""
        for kind in [k for k, (at, held, _) in self._kinds.items()
                     if not held and now - at >= self.every_s]:  # fmt: skip
            del self._kinds[kind]

    def flush(self) -> None:
        for state in self._kinds.values():
            self._held_out(state)
        self._kinds.clear()

    def _held_out(self, state: list) -> None:
        if state[1]:
            level, message, args = state[2]
            self.logger.log(level, f"{state[1]} lines like this one were not logged: {message}",
                            *args)  # fmt: skip


FORMATS = ("text", "json")
ENV = "TANDEM_LOG_FORMAT"


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or request_id.get()
        record.request_id = rid
        record.request = f" [request={rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "process": self.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if getattr(record, "request_id", ""):
            line["request_id"] = record.request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def log_format(given: str | None = None) -> str:
    fmt = given or os.environ.get(ENV) or "text"
    if fmt not in FORMATS:
        raise ConfigError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r} ({ENV})")
    return fmt


def configure(process: str, level: int = logging.INFO, fmt: str | None = None, stream=None) -> None:
    """Log to ``stream`` (default stderr) as ``process`` ("router", "prefill", ...)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_RequestId())
    if log_format(fmt) == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(
            logging.Formatter(
                f"tandem {process} %(asctime)s %(levelname)s %(name)s%(request)s: %(message)s"
            )
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def fatal(message: str, exc_info: bool = False) -> None:
    """A process's last word before it exits: ``tandem: error: MESSAGE`` on stderr, or
    in the JSON format an ERROR record (with the traceback if ``exc_info``), so that
    every line of a JSON log is JSON, the reason it ended included."""
    if _json_configured():
        logging.getLogger("tandem").error("%s", message, exc_info=exc_info)
        return
    if exc_info:
        import traceback

        traceback.print_exc()
    print(f"tandem: error: {message}", file=sys.stderr, flush=True)


def _json_configured() -> bool:
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
