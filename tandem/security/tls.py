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


def read_pem(path: str, setting: str, kind: str = "certificate") -> bytes:
    """The bytes of a PEM file of ``kind``: "certificate" (one or more: a chain, or a
    CA bundle) or "key" (a private key, unencrypted as gRPC needs it). A missing or
    unreadable file, or one that holds something else (a key given as a CA, the
    certificate and key swapped), fails naming ``setting``: gRPC only finds out at
    the first handshake, as an UNAVAILABLE that reads like an outage."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{setting}: {path} is not a PEM file")
    try:
        _load(data, kind)
    except (ValueError, TypeError) as exc:  # TypeError: an encrypted key
        what = "a private key" if kind == "key" else "a certificate"
        raise ConfigError(f"{setting}: {path} does not hold {what} ({exc})") from None
    return data


def read_cert_and_key(
    cert_path: str, key_path: str, cert_setting: str, key_setting: str
) -> tuple[bytes, bytes]:
    """``read_pem`` of both, and the key must be the (first) certificate's."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    cert, key = read_pem(cert_path, cert_setting), read_pem(key_path, key_setting, "key")
    public = [_load(cert, "certificate")[0].public_key(), _load(key, "key").public_key()]
    spki = [k.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo) for k in public]
    if spki[0] != spki[1]:
        raise ConfigError(f"{key_setting}: {key_path} is not the private key of "
                          f"{cert_setting}'s certificate ({cert_path})")  # fmt: skip
    return cert, key


def _load(data: bytes, kind: str):
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    if kind == "key":
        return load_pem_private_key(data, password=None)
    return x509.load_pem_x509_certificates(data)


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
