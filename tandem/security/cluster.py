"""``ClusterCredentials``: what a member of one cluster holds, in memory.

    ca         the cluster CA's certificate: peers must present a certificate it signed
    cert, key  this member's certificate and key, presented as server and as client
    kv_secret  the shared secret that authenticates every KV connection (>= 16 bytes)

Every process of a cluster (router, prefill and decode workers) holds the same
four. Inside the cluster the router calls workers over mutual TLS, and a
worker refuses a caller without a certificate from the cluster CA; prefill and
decode workers prove the KV secret to each other before any KV moves. See
pki.py for why a client checks the name ``server_name`` rather than the address.

Where they come from: ``ClusterCredentials.create()`` makes a throw-away set
(the local launcher does, per run; ``tandem ray up`` does, per cluster), and
``load`` reads an operator's own files named by a ``ClusterSecurityConfig``.
The key and the secret never appear in a repr, a log line or a command line.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.config import ClusterSecurityConfig
from tandem.errors import ConfigError
from tandem.kv_transfer.auth import MIN_SECRET_BYTES
from tandem.security import pki
from tandem.security.files import write_private
from tandem.security.tls import (
    channel_credentials,
    read_cert_and_key,
    read_pem,
    server_credentials,
)

KV_SECRET_BYTES = 32  # random bytes, kept as 64 hex characters (what the file holds)


@dataclass(frozen=True)
class ClusterCredentials:
    ca: bytes = field(repr=False)
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    kv_secret: bytes = field(repr=False)
    server_name: str = pki.CLUSTER_SERVER_NAME  # "": check the dialled address instead

    def __post_init__(self) -> None:
        if len(self.kv_secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"the KV secret must be at least {MIN_SECRET_BYTES} bytes, "
                f"got {len(self.kv_secret)}"
            )

    @classmethod
    def create(cls) -> ClusterCredentials:
        """A throw-away CA, one member certificate and a fresh KV secret."""
        ca = pki.make_ca()
        member = pki.cluster_member(ca)
        return cls(ca.cert, member.cert, member.key, secrets.token_hex(KV_SECRET_BYTES).encode())

    @classmethod
    def load(cls, config: ClusterSecurityConfig) -> ClusterCredentials | None:
        """From the files ``config`` names; None when it names none (TLS off inside)."""
        files = {
            "cluster.ca_file": config.ca_file,
            "cluster.cert_file": config.cert_file,
            "cluster.key_file": config.key_file,
            "cluster.kv_secret_file": config.kv_secret_file,
        }
        given = [name for name, path in files.items() if path]
        if not given:
            return None
        missing = [name for name, path in files.items() if not path]
        if missing:
            raise ConfigError(
                f"cluster security needs all of {', '.join(files)}; "
                f"{', '.join(given)} given, {', '.join(missing)} missing"
            )
        try:
            secret = Path(config.kv_secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                f"cluster.kv_secret_file: cannot read {config.kv_secret_file}: "
                f"{exc.strerror or exc}"
            ) from None
        cert, key = read_cert_and_key(config.cert_file, config.key_file,
                                      "cluster.cert_file", "cluster.key_file")  # fmt: skip
        return cls(
            ca=read_pem(config.ca_file, "cluster.ca_file"),
            cert=cert,
            key=key,
            kv_secret=secret,
            server_name=config.server_name,
        )

    def write(self, directory: str | Path) -> ClusterSecurityConfig:
        """Write the four files (owner-only) into ``directory``; the config naming them."""
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        paths = {}
        files = {"ca.pem": self.ca, "member.pem": self.cert,
                 "member-key.pem": self.key, "kv-secret": self.kv_secret}  # fmt: skip
        for name, data in files.items():
            path = directory / name
            write_private(path, data)
            paths[name] = str(path)
        return ClusterSecurityConfig(
            ca_file=paths["ca.pem"],
            cert_file=paths["member.pem"],
            key_file=paths["member-key.pem"],
            kv_secret_file=paths["kv-secret"],
            server_name=self.server_name,
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS: callers must present a certificate from the cluster CA."""
        return server_credentials(self.cert, self.key, client_ca=self.ca)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca, self.cert, self.key)

    def dial(self, address: str) -> grpc.Channel:
        """A blocking channel to a member, as a member (tools, benchmarks, tests)."""
        return grpc.secure_channel(
            address, self.channel_credentials(), options=self.channel_options()
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if not self.server_name:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]
