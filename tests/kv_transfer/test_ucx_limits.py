"""What a UCX receiver lets in: connections to its host only."""

from __future__ import annotations

import socket

import psutil
import pytest

from tandem.kv_transfer import make_receiver, make_sender
from tandem.kv_transfer.ucx import sockets
from tests.kv_transfer.conftest import fingerprint, make_side

pytest.importorskip("ucxx")


def _other_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback, if it has one."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.mark.parametrize(("host", "elsewhere"), [("127.0.0.1", False), ("0.0.0.0", True)])
def test_the_listener_takes_connections_to_its_host_only(host: str, elsewhere: bool) -> None:
    # "0.0.0.0" is the control: the same check passes there, so the other address is
    # reachable at all and it is the restriction to 127.0.0.1 that keeps it out.
    other = _other_ipv4()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    receiver = make_receiver("ucx", make_side(4).kv, fingerprint(), host=host)
    sender = make_sender("ucx", make_side(4).kv, fingerprint())
    try:
        assert _reachable(other, receiver.port) is elsewhere
        sender.connect(f"127.0.0.1:{receiver.port}")  # the KV protocol works on loopback
    finally:
        sender.close()
        receiver.close()


def test_listen_addresses() -> None:
    assert sockets.listen_addresses("0.0.0.0") == sockets.listen_addresses("") == []
    assert sockets.listen_addresses("localhost") == ["127.0.0.1"]
    assert sockets.listen_addresses("127.0.0.1") == ["127.0.0.1"]
