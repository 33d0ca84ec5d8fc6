from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tandem.kv_transfer import payload as payload_module
from tandem.kv_transfer.payload import (
    HeaderError,
    PayloadBuffers,
    check_fits,
    checksum,
    checksum_blocks,
    decode_header,
    encode_header,
    gather,
    make_header,
    paired_runs,
    scatter,
)
from tests.kv_transfer.conftest import make_side


def test_gather_scatter_moves_unordered_blocks_to_other_ids() -> None:
    src, dst = make_side(16, seed=1), make_side(16)
    src_ids, dst_ids = [9, 2, 14, 0], [3, 11, 1, 7]
    payload = gather(src.kv, src_ids, (0, 4))
    assert payload.shape == (4, 2, 4, 16, 2, 8) and payload.is_contiguous()
    scatter(dst.kv, dst_ids, (0, 4), payload)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst.kv[:, :, d], src.kv[:, :, s])
    untouched = [b for b in range(17) if b not in dst_ids]
    assert not dst.kv[:, :, untouched].any()


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [
        (list(range(3, 11)), list(range(20, 28))),  # one run each: slice copies
        ([9, 10, 11, 2, 3, 30, 5], [1, 2, 3, 12, 13, 0, 31]),  # a few runs
        (list(range(0, 40, 2)), list(range(39, -1, -2))),  # more runs than MAX_SLICE_RUNS
    ],
    ids=["runs", "few-runs", "scattered"],
)
def test_gather_and_scatter_equal_the_indexed_copies(monkeypatch, src_ids, dst_ids) -> None:
    monkeypatch.setattr(payload_module, "MAX_SLICE_RUNS", 8)
    src, dst = make_side(48, seed=7), make_side(48, seed=8)
    want_payload = src.kv[1:4].index_select(2, torch.tensor(src_ids))
    payload = gather(src.kv, src_ids, (1, 4))
    assert torch.equal(payload, want_payload) and payload.is_contiguous()
    out = torch.empty_like(payload)
    assert gather(src.kv, src_ids, (1, 4), out=out) is out and torch.equal(out, want_payload)
    want = dst.kv.clone()
    want[1:4].index_copy_(2, torch.tensor(dst_ids), payload)
    scatter(dst.kv, dst_ids, (1, 4), payload)
    assert torch.equal(dst.kv, want)


def test_layer_range_touches_only_those_layers() -> None:
    src, dst = make_side(8, seed=2), make_side(8)
    scatter(dst.kv, [5], (1, 3), gather(src.kv, [4], (1, 3)))
    assert torch.equal(dst.kv[1:3, :, 5], src.kv[1:3, :, 4])
    assert not dst.kv[0].any() and not dst.kv[3].any()


def test_header_round_trip() -> None:
    src = make_side(8, seed=3)
    payload = gather(src.kv, [1, 2], (2, 4))
    h = make_header("req-7", (2, 4), (1, 2), (6, 0), payload, first_token=42, final=True)
    assert h.nbytes == payload.numel() * 4 and h.checksum == checksum(payload)
    assert decode_header(encode_header(h)) == h
    check_fits(h, make_side(8).kv)


def test_empty_final_header_round_trip() -> None:
    h = make_header("r", (4, 4), (1,), (2,), None, first_token=5, final=True)
    assert h.nbytes == 0 and h.shape == ()
    assert decode_header(encode_header(h)) == h


def test_a_header_with_the_old_extra_field_is_refused() -> None:
    # Protocol 2 appended the sampler's RNG state; a header of that shape is not ours.
    body = json.loads(encode_header(make_header("r", (4, 4), (1,), (2,), None, 5, final=True)))
    with pytest.raises(HeaderError, match="bad magic or field count"):
        decode_header(json.dumps([*body, None]).encode())


def test_checksum_sees_one_flipped_bit() -> None:
    payload = gather(make_side(4, seed=4).kv, [0], (0, 1))
    before = checksum(payload)
    payload.view(torch.int32).view(-1)[17] ^= 1
    assert checksum(payload) != before


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"nbytes": 12}, "nbytes"),
        ({"shape": (2, 2, 3, 16, 2, 8)}, "shape"),
        ({"dst_block_ids": (6,)}, "destination blocks"),
        ({"layer_start": 5}, "layer range"),
        ({"request_id": ""}, "request_id"),
        ({"dtype": "int7"}, "dtype"),
    ],
)
def test_decode_rejects_inconsistent_headers(change: dict, message: str) -> None:
    payload = gather(make_side(8, seed=5).kv, [1, 2], (2, 4))
    h = make_header("r", (2, 4), (1, 2), (6, 0), payload)
    with pytest.raises(HeaderError, match=message):
        decode_header(encode_header(dataclasses.replace(h, **change)))


def test_decode_rejects_garbage() -> None:
    with pytest.raises(HeaderError):
        decode_header(b"\xff\x00")
    with pytest.raises(HeaderError, match="magic"):
        decode_header(b'["nope"]')


def test_check_fits_rejects_foreign_layouts() -> None:
    payload = gather(make_side(8, seed=6).kv, [1], (0, 4))
    h = make_header("r", (0, 4), (1,), (9,), payload)
    with pytest.raises(HeaderError, match="outside the pool"):
        check_fits(h, make_side(8).kv)  # block 8 is the null block, 9 is past it
    with pytest.raises(HeaderError, match="past 2 layers"):
        check_fits(h, make_side(16, layers=2).kv)
    with pytest.raises(HeaderError, match="dtype"):
        check_fits(dataclasses.replace(h, dst_block_ids=(1,)), make_side(8).kv.half())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_payloads(dtype: torch.dtype) -> None:
    src, dst = make_side(8, seed=7), make_side(8)
    src.kv, dst.kv = src.kv.to(dtype), dst.kv.to(dtype)
    payload = gather(src.kv, [3, 1], (0, 4))
    h = make_header("r", (0, 4), (3, 1), (0, 2), payload)
    assert decode_header(encode_header(h)) == h and h.nbytes == payload.numel() * 2
    check_fits(h, dst.kv)
    assert h.checksum == checksum(payload.clone())
    scatter(dst.kv, [0, 2], (0, 4), payload)
    assert torch.equal(dst.kv[:, :, [0, 2]], src.kv[:, :, [3, 1]])


def test_payload_buffers_reuse_what_fits_and_bound_what_idles() -> None:
    pool = PayloadBuffers(max_idle_bytes=10_000)
    a = pool.take((10, 100), torch.float32, torch.device("cpu"))  # 4,000 B
    ptr = a.data_ptr()
    pool.give(a)
    assert pool.idle_bytes == 4000
    b = pool.take((5, 100), torch.bfloat16, torch.device("cpu"))  # 1,000 B: too small a fit
    assert b.data_ptr() != ptr and pool.idle_bytes == 4000
    c = pool.take((2, 3, 100), torch.float32, torch.device("cpu"))  # 2,400 B: reuses a
    assert c.data_ptr() == ptr and c.shape == (2, 3, 100) and c.is_contiguous()
    assert pool.idle_bytes == 0
    pool.give(c)  # the whole 4,000 B buffer comes back, not the 2,400 B view
    pool.give(pool.take((2000,), torch.float32, torch.device("cpu")))  # 8,000 B
    assert pool.idle_bytes == 4000  # 12,000 B would exceed the bound: the largest goes
    pool.give(None)  # an empty message has no payload
    assert pool.idle_bytes == 4000


@pytest.mark.parametrize(
    "ids", [[0, 1, 2, 3], [5, 6, 1, 2, 9], [7, 3, 4, 0], [2]], ids=["one-run", "three", "four", "1"]
)
@pytest.mark.parametrize("layers", [(0, 4), (1, 3), (2, 3)])
def test_blocks_checksummed_in_place_match_the_gathered_payload(ids, layers) -> None:
    kv = torch.randn(4, 2, 11, 16, 2, 8)
    assert checksum_blocks(kv, ids, layers) == checksum(gather(kv, ids, layers))
    changed = kv.clone()
    changed[layers[0], 1, ids[-1], 3, 1, 7] += 1  # one value of the last block's V
    assert checksum_blocks(changed, ids, layers) != checksum_blocks(kv, ids, layers)


def test_paired_runs_cover_both_lists_in_order() -> None:
    src, dst = [4, 5, 6, 9, 10, 2], [0, 1, 7, 8, 9, 3]
    runs = paired_runs(src, dst)
    assert runs == [(4, 0, 2), (6, 7, 1), (9, 8, 2), (2, 3, 1)]
    assert [s + i for s, _, n in runs for i in range(n)] == src
    assert [d + i for _, d, n in runs for i in range(n)] == dst
