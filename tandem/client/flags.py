"""The command-line flags of every command that connects to a router, defined once.

    --tls-ca FILE        verify the router with this CA (PEM) and speak TLS
    --tls                TLS with the system's root certificates (no --tls-ca)
    --tls-cert FILE      a client certificate for mutual TLS (with --tls-key)
    --tls-key FILE
    --api-key-file FILE  a file holding the API key; else $TANDEM_API_KEY

``tandem generate --router``, ``tandem bench load`` / ``sweep`` and ``tandem demo``
add them with ``add_client_flags`` and hand ``client_kwargs(args)`` to the
clients. The key is read from a file because a command line is visible to every
user of the machine (ps).
"""

from __future__ import annotations

import argparse
from typing import Any

from tandem.client._connect import read_api_key_file


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("connection to the router")
    g.add_argument("--tls", action="store_true", help="TLS, verified by the system's roots")
    g.add_argument("--tls-ca", metavar="FILE", help="TLS, verified by this CA (PEM)")
    g.add_argument("--tls-cert", metavar="FILE", help="client certificate for mutual TLS (PEM)")
    g.add_argument("--tls-key", metavar="FILE", help="its private key (PEM)")
    g.add_argument(
        "--api-key-file", metavar="FILE", help="file holding the API key (default: $TANDEM_API_KEY)"
    )


def client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for ``TandemClient`` / ``AsyncTandemClient``."""
    api_key = read_api_key_file(args.api_key_file) if args.api_key_file else None
    return {
        "tls": True if args.tls else None,
        "ca_file": args.tls_ca,
        "cert_file": args.tls_cert,
        "key_file": args.tls_key,
        "api_key": api_key,
    }
