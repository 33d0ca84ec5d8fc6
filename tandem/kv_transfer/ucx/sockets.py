"""Socket facts that ucxx (0.52) does not expose: a peer's address, and binding a listener.

Peer address: ucxx's Endpoint gives its ``ucp_ep_h``; ``ucp_ep_query`` (UCX's C
API, called through ctypes) returns the endpoint's local and remote sockaddr for
endpoints made by a listener or by connecting to one.

Binding: ucxx's ``create_listener`` takes a port only and listens on 0.0.0.0
(libucxx's C++ ``ListenerBuilder`` has a host option, its Python binding does
not, and no UCX_* setting moves the sockaddr listener; UCX_NET_DEVICES only
restricts the transports). So the KV listener is pinned to its host after the
fact: a four-instruction classic BPF socket filter on the listening socket
drops every TCP segment whose destination address is not the host's. The
kernel runs a listener's filter on incoming SYNs (tcp_v4_rcv), so a connection
to any other address of the machine is never established: to a client, the
port looks firewalled. The filter exists from a few milliseconds after the
listener does; a connection that slipped in between still has to pass the
handshake (auth.py).

Linux only; IPv4 only (the listener ucxx creates is IPv4). A host that is a
wildcard ("", "0.0.0.0") means every interface and gets no filter.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct

import psutil

WILDCARD_HOSTS = ("", "0.0.0.0")
_SO_ATTACH_FILTER = 26  # asm-generic/socket.h (not in Python's socket module)
_SKF_NET_OFF = -0x100000  # BPF loads relative to the IP header, not the TCP one
_UCP_EP_ATTR_REMOTE_SOCKADDR = 1 << 2


class _EpAttr(ctypes.Structure):
    """ucp_ep_attr_t up to the two sockaddrs (ucp.h); the tail is room to spare."""

    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("name", ctypes.c_char * 32),  # UCP_ENTITY_NAME_MAX
        ("local", ctypes.c_uint8 * 128),  # struct sockaddr_storage
        ("remote", ctypes.c_uint8 * 128),
        ("tail", ctypes.c_uint8 * 256),
    ]


_ucp_ep_query = None


def _query_fn():
    global _ucp_ep_query
    if _ucp_ep_query is None:
        # ucxx has loaded libucp already: dlopen by soname returns that copy.
        fn = ctypes.CDLL("libucp.so.0").ucp_ep_query
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        _ucp_ep_query = fn
    return _ucp_ep_query


def _format(sockaddr: bytes) -> str:
    family = struct.unpack_from("=H", sockaddr)[0]
    port = struct.unpack_from("!H", sockaddr, 2)[0]
    if family == socket.AF_INET:
        return f"{socket.inet_ntop(socket.AF_INET, sockaddr[4:8])}:{port}"
    if family == socket.AF_INET6:
        return f"[{socket.inet_ntop(socket.AF_INET6, sockaddr[8:24])}]:{port}"
    return f"unknown address family {family}"


def peer_address(ep) -> str:
    """The remote "ip:port" of a ucxx endpoint, or why UCX could not tell."""
    try:
        attr = _EpAttr(field_mask=_UCP_EP_ATTR_REMOTE_SOCKADDR)
        status = _query_fn()(ep.ucp_endpoint, ctypes.byref(attr))
    except (OSError, AttributeError) as exc:  # another UCX build, or the endpoint is gone
        return f"unknown address ({exc})"
    if status != 0:
        return f"unknown address (ucp_ep_query status {status})"
    return _format(bytes(attr.remote))


def listen_addresses(host: str) -> list[str]:
    """The IPv4 addresses a listener for ``host`` must accept ([] for a wildcard)."""
    if host in WILDCARD_HOSTS:
        return []
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"host {host!r} does not resolve to an IPv4 address: {exc}") from None
    return sorted({info[4][0] for info in infos})


def _filter_program(addresses: list[str]) -> bytes:
    """cBPF: accept a packet whose IPv4 destination is one of ``addresses``, drop the rest."""
    n = len(addresses)
    # ld [net + 16] (the IPv4 destination), one jeq per address, ret 0 (drop), ret -1 (keep)
    code = [(0x20, 0, 0, (_SKF_NET_OFF + 16) & 0xFFFFFFFF)]
    for i, addr in enumerate(addresses):
        value = struct.unpack("!I", socket.inet_aton(addr))[0]
        code.append((0x15, n - i, 0, value))  # jeq: jump to "keep", else next
    code += [(0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFFFFFF)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in code)


def restrict_listener(port: int, host: str) -> None:
    """Make this process's TCP listener on ``port`` accept connections to ``host`` only.

    Raises ValueError naming ``host`` when that cannot be done, rather than leave
    the port open on every interface.
    """
    addresses = listen_addresses(host)
    if not addresses:
        return
    proc = psutil.Process()
    connections = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6
    listening = [
        c
        for c in connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    if not listening:
        raise ValueError(f"no listening socket on port {port} to restrict to host {host!r}")
    program = _filter_program(addresses)
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HP", len(program) // 8, ctypes.addressof(buf))  # struct sock_fprog
    for conn in listening:
        if conn.family != socket.AF_INET:
            raise ValueError(
                f"the KV listener on port {port} is not IPv4; cannot restrict it to {host!r}"
            )
        with socket.socket(fileno=os.dup(conn.fd)) as sock:  # the dup shares the socket
            sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
