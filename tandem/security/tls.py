"""TLS credentials for gRPC, from PEM files or bytes, and the loopback rule.

Secure by default: a port that only this machine can reach (loopback) may run
without TLS; any other bind needs TLS and authentication, or an explicit
``insecure`` setting, so that nobody exposes an open port by accident.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc

from tandem.errors import ConfigError


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of a PEM file; a missing or unreadable file fails naming ``setting``."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{setting}: {path} is not a PEM file")
    return data


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach ``host`` ("localhost", 127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def server_credentials(
    cert: bytes, key: bytes, client_ca: bytes | None = None
) -> grpc.ServerCredentials:
    """TLS with ``cert``/``key``; with ``client_ca``, mutual TLS: every client must
    present a certificate that CA signed, or the handshake fails."""
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def channel_credentials(
    ca: bytes | None = None, cert: bytes | None = None, key: bytes | None = None
) -> grpc.ChannelCredentials:
    """A client's TLS: ``ca`` verifies the server (None: the system's roots); ``cert``
    and ``key`` are presented to a server that asks for a client certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
