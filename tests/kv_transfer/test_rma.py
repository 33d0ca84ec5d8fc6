"""ucx/rma.py in one process: caches UCX allocates, their keys, and what a bad
description gets. Reads between processes are in test_ucx.py."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from tandem.kv_transfer import TransferError
from tests.kv_transfer.conftest import make_side

pytest.importorskip("ucxx")

from tandem.kv_transfer.ucx import rma, ucp  # noqa: E402  (after the skip: needs ucxx)
from tandem.kv_transfer.ucx.runtime import get_runtime  # noqa: E402


def test_a_ucx_allocated_cache_is_zeroed_found_by_its_views_and_freed_with_them() -> None:
    before = dict(rma._allocations)
    kv = rma.allocate_kv((2, 2, 5, 4, 2, 8), torch.float32, torch.device("cpu"))
    assert not kv.any() and kv.is_contiguous()
    (start,) = set(rma._allocations) - set(before)
    assert start == kv.data_ptr()
    assert rma._allocation_of(kv) is rma._allocation_of(kv[1, 0]) is not None
    assert rma._allocation_of(torch.zeros(4)) is None
    view = kv[1]
    del kv
    gc.collect()
    assert start in rma._allocations  # a view keeps the allocation
    del view
    gc.collect()
    assert start not in rma._allocations


def test_a_cuda_cache_is_left_to_torch() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    kv = rma.allocate_kv((1, 2, 3, 4, 1, 8), torch.float16, torch.device("cuda"))
    assert kv.is_cuda and rma._allocation_of(kv) is None


def _endpoint_pair():
    """A connected ucxx endpoint (ours) and the listener's, on this process's loop."""
    rt = get_runtime()
    accepted = []

    async def pair():
        listener = rt.ucxx.create_listener(lambda ep: accepted.append(ep))
        ep = await rt.ucxx.create_endpoint("127.0.0.1", listener.port)
        return listener, ep

    listener, ep = rt.submit(pair()).result(20)
    return listener, ep


def test_a_description_maps_the_peer_cache_or_is_refused_by_name() -> None:
    sender_side = make_side(6, seed=1, ucx=True)
    sender, reader = rma.CacheMemory(sender_side.kv), rma.CacheMemory(make_side(6).kv)
    listener, ep = _endpoint_pair()
    try:
        remote = reader.add_remote(ep.ucp_endpoint, sender.describe())
        assert remote.mapped and remote.total_blocks == 7
        assert torch.equal(remote.view, sender_side.kv)  # the peer's memory, seen in place
        reader.remove_remote(remote)
        unmapped = reader.add_remote(ep.ucp_endpoint, sender.describe(), map_peer=False)
        assert not unmapped.mapped
        reader.remove_remote(unmapped)
        good = json.loads(sender.describe())
        for bad, why in (
            (b"not json", "bad cache description"),
            (json.dumps({**good, "blocks": 1}).encode(), "1 blocks"),
            (json.dumps({**good, "rkey": "zz"}).encode(), "bad cache description"),
            (json.dumps({k: v for k, v in good.items() if k != "base"}).encode(), "'base'"),
            # A cache of another size than the one the fingerprint describes.
            (json.dumps({**good, "blocks": 9}).encode(), "not the \\[4, 2, 9"),
        ):
            with pytest.raises(ValueError, match=why):
                reader.add_remote(ep.ucp_endpoint, bad)
    finally:
        ep.abort()
        listener.close()
        sender.close()
        reader.close()


def test_a_read_names_source_blocks_outside_the_peer_pool() -> None:
    sender = rma.CacheMemory(make_side(4, seed=2, ucx=True).kv)
    reader = rma.CacheMemory(make_side(4).kv)
    listener, ep = _endpoint_pair()
    try:
        remote = reader.add_remote(ep.ucp_endpoint, sender.describe())
        with pytest.raises(TransferError, match=r"source block ids \[4\] outside") as err:
            reader.read(remote, (0, 4), (0, 1), (0, 1))
        assert err.value.reason == "bad header"
        reader.remove_remote(remote)
    finally:
        ep.abort()
        listener.close()
        sender.close()
        reader.close()


def test_the_ucx_worker_takes_calls_from_any_thread() -> None:
    ucp.check_thread_mode(get_runtime().worker)  # what rma.CacheMemory relies on
