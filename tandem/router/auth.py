"""API keys: who may call the router's public service.

Clients send ``authorization: Bearer <key>`` metadata on every call. When keys
are configured, every call except ``grpc.health.v1`` (load balancers probe it
without credentials) needs a valid key, or it ends with UNAUTHENTICATED and the
message "missing or invalid API key", which says nothing about any valid key.
Services added later are covered too: only health is exempt.

The keys file (``api_keys_file``), one key a line::

    # comments and blank lines are ignored; a "#" after a key starts a comment
    3f9c2a...e81b  name=alice max_streams=8 requests_per_s=2.5
    b7d004...19aa  name=batch-jobs max_streams=256
    6c1e55...0f3d

A key is at least 16 characters without spaces or "#" (``openssl rand -hex 32``
makes a good one). The optional fields after it: ``name`` (what logs and error
messages show; default ``key-`` and 8 hex digits of the key's SHA-256),
``max_streams`` and ``requests_per_s`` (that key's own limits, instead of
``key_max_streams`` and ``key_requests_per_s``; 0 is no limit). The environment
variable ``TANDEM_API_KEYS`` adds comma-separated keys with the default limits.
Keep the file owner-only; the key itself never appears on a command line, in a
log line or in a repr.

Only SHA-256 digests are kept. A presented key's digest is compared with every
stored digest by ``hmac.compare_digest``, without stopping at a match, so the
time taken says nothing about which key, or how much of one, matched.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health

from tandem import logs
from tandem.config import RouterConfig
from tandem.errors import ConfigError

log = logging.getLogger(__name__)

ENV_VAR = "TANDEM_API_KEYS"
MIN_KEY_CHARS = 16
UNAUTHENTICATED_MESSAGE = "missing or invalid API key"
_EXEMPT_PREFIX = f"/{health.SERVICE_NAME}/"

# The authenticated key of the call being served (None: keys are off). Set by the
# interceptor; gRPC runs the handler in the interceptor's contextvars.Context.
current_key: contextvars.ContextVar[ApiKey | None] = contextvars.ContextVar(
    "tandem_api_key", default=None
)


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes = field(repr=False)  # SHA-256 of the key
    max_streams: int | None = None  # None: RouterConfig.key_max_streams; 0: no limit
    requests_per_s: float | None = None  # None: RouterConfig.key_requests_per_s; 0: none

    def describe(self) -> str:
        return f"API key {self.name!r}" if self.digest else self.name

    @property
    def tenant(self) -> str:
        """The namespace of this key's request ids (12 hex digits of the digest): keys
        with the same name still never share ids."""
        return self.digest.hex()[:12]


# The callers of a router that requires client certificates and has no API keys: one
# party, under the keys' default limits (key_max_streams, key_requests_per_s), and
# with the keyless callers' request ids and prefix cache (its tenant is "").
CERTIFICATE_CALLERS = ApiKey("the shared key of the callers by client certificate", b"")


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The configured keys, by digest."""

    def __init__(self, keys: list[ApiKey]) -> None:
        if not keys:
            raise ConfigError("an API key list must not be empty")
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def load(cls, config: RouterConfig, environ: Mapping[str, str] = os.environ) -> ApiKeys | None:
        """From ``api_keys_file`` and ``TANDEM_API_KEYS``; None when neither names a key."""
        keys: list[ApiKey] = []
        where: dict[bytes, str] = {}  # digest -> where it was given, to name duplicates
        if config.api_keys_file:
            path = config.api_keys_file
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "strerror", None) or exc
                raise ConfigError(f"api_keys_file: cannot read {path}: {reason}") from None
            if os.stat(path).st_mode & 0o077:
                log.warning("api_keys_file %s can be read by other users: chmod 600 it", path)
            for n, line in enumerate(text.splitlines(), 1):
                key = parse_line(line, f"api_keys_file {path} line {n}")
                if key is not None:
                    keys.append(_unique(key, f"{path} line {n}", where))
        env = environ.get(ENV_VAR, "")
        for i, value in enumerate(v.strip() for v in env.split(",")):
            if value:
                key = _key(value, {}, f"{ENV_VAR} entry {i + 1}")
                keys.append(_unique(key, f"{ENV_VAR} entry {i + 1}", where))
        if not keys:
            if config.api_keys_file or env.strip():
                raise ConfigError(
                    f"no API key in {' or '.join(_sources(config, env))}: add keys or "
                    "remove the setting"
                )
            return None
        names = [k.name for k in keys]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f"API key name {name!r} is given to more than one key")
        log.info("%d API keys (from %s)", len(keys), " and ".join(_sources(config, env)))
        return cls(keys)

    def identify(self, metadata) -> ApiKey | None:
        """The key a call presents in its ``authorization: Bearer`` metadata, or None."""
        presented = bearer_token(metadata)
        if presented is None:
            return None
        d = digest(presented)
        found = None
        for key in self.keys:  # no early exit: the time does not depend on which matched
            if hmac.compare_digest(d, key.digest):
                found = key
        return found


def bearer_token(metadata) -> str | None:
    for name, value in metadata or ():
        if name == "authorization":
            scheme, _, token = (value if isinstance(value, str) else "").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


def parse_line(line: str, where: str) -> ApiKey | None:
    """One line of a keys file; None for a blank or comment line."""
    words = line.split("#", 1)[0].split()
    if not words:
        return None
    fields = {}
    for i, word in enumerate(words[1:], 2):
        name, eq, value = word.partition("=")
        if not eq or name not in ("name", "max_streams", "requests_per_s"):
            # Not echoed: a mangled line may hold part of a key.
            raise ConfigError(
                f"{where}: word {i} is none of name=..., max_streams=N, requests_per_s=X "
                "(the only fields that may follow the key)"
            )
        fields[name] = value
    return _key(words[0], fields, where)


def _key(secret: str, fields: dict[str, str], where: str) -> ApiKey:
    if len(secret) < MIN_KEY_CHARS or any(c.isspace() or c in "#," for c in secret):
        raise ConfigError(
            f"{where}: an API key must be at least {MIN_KEY_CHARS} characters without "
            "spaces, '#' or ','; make one with `openssl rand -hex 32`"
        )
    d = digest(secret)
    name = fields.get("name") or f"key-{d.hex()[:8]}"
    max_streams = requests_per_s = None
    if "max_streams" in fields:
        try:
            max_streams = int(fields["max_streams"])
        except ValueError:
            max_streams = -1
        if max_streams < 0:
            raise ConfigError(
                f"{where}: max_streams must be an integer >= 0, got {fields['max_streams']!r}"
            )
    if "requests_per_s" in fields:
        try:
            requests_per_s = float(fields["requests_per_s"])
        except ValueError:
            requests_per_s = -1.0
        if not (requests_per_s >= 0 and math.isfinite(requests_per_s)):
            raise ConfigError(
                f"{where}: requests_per_s must be a number >= 0, got {fields['requests_per_s']!r}"
            )
    return ApiKey(name, d, max_streams, requests_per_s)


def _unique(key: ApiKey, here: str, where: dict[bytes, str]) -> ApiKey:
    if key.digest in where:
        raise ConfigError(f"{here}: the same API key as {where[key.digest]}")
    where[key.digest] = here
    return key


def _sources(config: RouterConfig, env: str) -> list[str]:
    sources = [f"api_keys_file {config.api_keys_file}"] if config.api_keys_file else []
    return sources + ([ENV_VAR] if env.strip() else [])


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health without a valid key; sets ``current_key``."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys
        # Anyone who reaches the port may be refused at any rate: a line per method
        # every 10 s, with a count (flushed by the router's stop).
        self.refused = logs.Throttle(log)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_EXEMPT_PREFIX):
            return handler
        key = self.keys.identify(details.invocation_metadata)
        if key is None:
            self.refused.log(logging.INFO, "refused %s: %s", details.method,
                             UNAUTHENTICATED_MESSAGE, kind=details.method)  # fmt: skip
            return _refusal(handler)
        current_key.set(key)
        return handler


async def _refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that refuses the call."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        _refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
