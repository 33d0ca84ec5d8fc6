"""What the router's public port requires, read once at start-up.

    tls_cert_file, tls_key_file   the port speaks TLS (PEM files)
    tls_client_ca_file            mutual TLS: clients present a certificate it signed
    api_keys_file, TANDEM_API_KEYS  every call but health needs a key (auth.py)

Secure by default: a router whose ``host`` is not loopback refuses to start unless
it has TLS *and* authentication (API keys or a client CA), because keys without
TLS would travel in clear and a port without either serves anyone who reaches it.
``insecure: true`` (``--insecure``) allows it, for example behind a proxy that
ends TLS. On loopback, where only this machine can connect, both stay optional.

Connections are bounded before any key is seen: a connection costs the router a
file descriptor, and descriptors run out for every port at once. The HTTP port
holds at most half of them (http/server.py) and the gRPC port a quarter
(``grpc_connection_options``), leaving the rest for the workers and files.
"""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from tandem.config import RouterConfig
from tandem.errors import ConfigError
from tandem.router.auth import ENV_VAR, ApiKeys
from tandem.security import tls

log = logging.getLogger(__name__)

# The gRPC port: a connection with no call for this long is closed (gRPC keeps one
# that finished its handshake and never calls for good; a client reconnects by itself
# at its next call), and a client in a call is pinged this often, so that one that
# froze or whose host went away is let go when a ping goes unanswered.
IDLE_CONNECTION_S = 120.0
# grpc.aio closes an idle connection only if it never made a call: one that made a
# call and went quiet, or holds a Health.Watch, stayed for good, and enough of them
# (no key needed) held every descriptor the port may use. So every connection is also
# sent GOAWAY at an age (gRPC adds +-10%) and closed once its calls have ended, or
# after the grace; clients reconnect by themselves, streams in flight go on.
MAX_CONNECTION_AGE_S, CONNECTION_AGE_GRACE_S = 600.0, 3600.0
# Streams one connection may hold open (unbounded, each costs the router memory).
MAX_STREAMS_PER_CONNECTION = 1024
CLIENT_PING_S, CLIENT_PING_TIMEOUT_S = 60.0, 20.0
# Health.Watch streams open at once across the port (server.py): no key is needed for
# one, and each holds a call and a task for up to a connection's age and grace, so
# that connections times streams per connection of them would hold the router's memory.
MAX_HEALTH_WATCHES = 1024


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit on open descriptors to its hard limit, as servers
    do (a shell's soft limit is often 1024, which bounds the connections the ports
    may hold); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # a kernel bound below the hard limit
            log.info("open descriptors stay at %d: %s", soft, exc)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(share: float) -> int:
    """``share`` of the descriptors this process may open, between 64 and 8192."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(8192, int(soft * share) if soft != resource.RLIM_INFINITY else 8192))


def grpc_connection_options() -> list[tuple[str, int]]:
    """The public gRPC server's bounds on its connections."""
    return [
        ("grpc.max_connection_idle_ms", round(IDLE_CONNECTION_S * 1000)),
        ("grpc.max_connection_age_ms", round(MAX_CONNECTION_AGE_S * 1000)),
        ("grpc.max_connection_age_grace_ms", round(CONNECTION_AGE_GRACE_S * 1000)),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.max_allowed_incoming_connections", connection_cap(0.25)),
        ("grpc.keepalive_time_ms", round(CLIENT_PING_S * 1000)),
        ("grpc.keepalive_timeout_ms", round(CLIENT_PING_TIMEOUT_S * 1000)),
    ]


@dataclass(frozen=True)
class PublicPort:
    credentials: grpc.ServerCredentials | None  # None: plaintext
    keys: ApiKeys | None  # None: no API keys
    client_ca: bool  # clients must present a certificate

    @classmethod
    def load(cls, config: RouterConfig, environ: Mapping[str, str] = os.environ) -> PublicPort:
        """Reads the files and keys; a missing file, a bad key or an exposed port fails
        with the setting named."""
        credentials = None
        if config.tls_cert_file:
            cert, key = tls.read_cert_and_key(config.tls_cert_file, config.tls_key_file,
                                              "tls_cert_file", "tls_key_file")  # fmt: skip
            ca = None
            if config.tls_client_ca_file:
                ca = tls.read_pem(config.tls_client_ca_file, "tls_client_ca_file")
            credentials = tls.server_credentials(cert, key, client_ca=ca)
        port = cls(credentials, ApiKeys.load(config, environ), bool(config.tls_client_ca_file))
        port.check_exposure(config)
        return port

    def check_exposure(self, config: RouterConfig) -> None:
        if tls.is_loopback(config.host):
            return
        missing = []
        if self.credentials is None:
            missing.append("TLS (tls_cert_file and tls_key_file; API keys would travel in clear)")
        if self.keys is None and not self.client_ca:
            missing.append(f"authentication (api_keys_file or {ENV_VAR}, or tls_client_ca_file)")
        if not missing:
            return
        if config.insecure:
            what = " and without ".join(m.split(" (")[0] for m in missing)
            log.warning("the router listens on %s without %s (insecure: true)", config.host, what)
            return
        raise ConfigError(
            f"the router's host {config.host!r} is not loopback and it has no "
            f"{' and no '.join(missing)}: anyone who reaches the port could use it. "
            "Configure them, or set insecure: true (--insecure) to allow this"
        )
