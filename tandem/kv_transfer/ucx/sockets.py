"""Socket facts that ucxx (0.52) does not expose: a peer's address.

ucxx's Endpoint gives its ``ucp_ep_h``; ``ucp_ep_query`` (UCX's C API, called
through ctypes) returns the endpoint's local and remote sockaddr for endpoints
made by a listener or by connecting to one.
"""

from __future__ import annotations

import ctypes
import socket
import struct

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
