"""How both clients reach a router: TLS, client certificates and the API key.

``Connection.make`` turns the clients' keyword arguments into channel
credentials and the metadata sent with every call; ``sync_channel`` and
``aio_channel`` open the channel. An API key goes in ``authorization: Bearer``
metadata. It is never sent in clear off this machine: a key without TLS to an
address that is not loopback is refused before any connection is made.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc

from tandem import keepalive
from tandem.config import check_address
from tandem.errors import ConfigError
from tandem.security import tls

API_KEY_ENV = "TANDEM_API_KEY"
# The clients ping a router every KEEPALIVE_S while a call is open, and fail the call
# with UNAVAILABLE when a ping is not answered within KEEPALIVE_TIMEOUT_S: a router
# whose host went away, or whose process froze, sends no reset, and a stream with no
# deadline waited on it for ever. (Routers accept pings at any rate; a proxy in
# between may not: ``keepalive_s=None`` turns the pings off.)
KEEPALIVE_S = 30.0
KEEPALIVE_TIMEOUT_S = 20.0
MAX_KEEPALIVE_S = keepalive.MAX_KEEPALIVE_S


@dataclass(frozen=True)
class Connection:
    address: str
    credentials: grpc.ChannelCredentials | None = field(default=None, repr=False)  # None: plaintext
    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    options: tuple[tuple[str, int], ...] = ()  # the channel's

    @classmethod
    def make(
        cls,
        address: str,
        *,
        tls_on: bool | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        api_key: str | None = None,
        keepalive_s: float | None = KEEPALIVE_S,
        environ: Mapping[str, str] = os.environ,
    ) -> Connection:
        """``tls_on`` None: TLS when any of the files is given. ``ca_file`` None with
        TLS: the system's root certificates. ``api_key`` None: $TANDEM_API_KEY.
        ``keepalive_s`` None: no pings."""
        files = ca_file or cert_file or key_file
        if tls_on is False and files:
            raise ConfigError("ca_file, cert_file and key_file are for TLS, but tls=False")
        if bool(cert_file) != bool(key_file):
            raise ConfigError("a client certificate needs both cert_file and key_file")
        credentials = None
        if tls_on or files:
            ca = tls.read_pem(ca_file, "ca_file") if ca_file else None
            cert_pem = key_pem = None
            if cert_file:
                cert_pem, key_pem = tls.read_cert_and_key(cert_file, key_file, "cert_file",
                                                          "key_file")  # fmt: skip
            credentials = tls.channel_credentials(ca, cert_pem, key_pem)
        for target in _targets(address):
            check_address(target, "router address", port_required=False)
        key = checked_api_key(address, api_key, credentials is not None, environ)
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        options = ()
        if keepalive_s is not None:
            number = isinstance(keepalive_s, numbers.Real) and not isinstance(keepalive_s, bool)
            if not (number and 0 < keepalive_s <= MAX_KEEPALIVE_S):
                raise ConfigError(f"keepalive_s must be seconds in (0, {MAX_KEEPALIVE_S:,}] "
                                  f"or None (no pings), got {keepalive_s!r}")  # fmt: skip
            timeout_s = min(KEEPALIVE_TIMEOUT_S, keepalive_s)
            options = tuple(keepalive.channel_options(keepalive_s, timeout_s))
        return cls(address, credentials, metadata, options)

    def sync_channel(self) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.address, self.options)
        return grpc.secure_channel(self.address, self.credentials, self.options)

    def aio_channel(self) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.address, self.options)
        return grpc.aio.secure_channel(self.address, self.credentials, self.options)


def checked_api_key(
    address: str, api_key: str | None, secure: bool, environ: Mapping[str, str] = os.environ
) -> str:
    """The key to send to ``address`` ("": none): ``api_key``, else $TANDEM_API_KEY;
    refused when it cannot be sent as a header, or would go in clear (not ``secure``)
    to an address that is not loopback."""
    key = (api_key if api_key is not None else environ.get(API_KEY_ENV, "")).strip()
    if key and not (key.isascii() and key.isprintable()):
        source = "api_key" if api_key is not None else f"${API_KEY_ENV}"
        raise ConfigError(
            f"{source}: an API key is printable ASCII (metadata cannot carry other "
            "characters); check the key's file or variable"
        )
    if key and not secure and not all(tls.is_loopback(host) for host in _hosts(address)):
        raise ConfigError(
            f"refusing to send an API key in clear to {address}: connect with TLS "
            "(tls=True or ca_file; --tls-ca on the command line) or over loopback"
        )
    return key


def read_api_key_file(path: str) -> str:
    """The key in a file of its own (surrounding whitespace ignored)."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"--api-key-file: cannot read {path}: {reason}") from None
    if not key or any(c.isspace() for c in key):
        raise ConfigError(f"--api-key-file: {path} must hold one API key and nothing else")
    return key


def _hosts(address: str) -> tuple[str, ...]:
    """The hosts of "host:port", "[v6]:port" or a gRPC target: "dns:[//authority/]host:port",
    "ipv4:" or "ipv6:" and a comma-separated list, "unix:" (this machine)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return ("localhost",)  # a socket file: this machine only
    return tuple(_host(target) for target in _targets(address))


def _targets(address: str) -> tuple[str, ...]:
    """The "host[:port]" parts of an address (none for a socket file)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return ()
    scheme, sep, rest = address.partition(":")
    if sep and scheme in ("ipv4", "ipv6"):
        return tuple(rest.split(","))
    if sep and scheme == "dns":
        return (rest.split("/")[-1],)  # past "//authority/" when there is one
    return (address,)


def _host(target: str) -> str:
    if target.startswith("["):
        return target[1 : target.find("]")]
    host, sep, port = target.rpartition(":")
    return host if sep and port.isdigit() else target
