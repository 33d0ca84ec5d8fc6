from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import xxhash

from tandem.kv_transfer.payload import (
    HeaderError,
    as_bytes,
    check_fits,
    checksum_blocks,
    copy_blocks,
    decode_header,
    encode_header,
    make_header,
    paired_runs,
)
from tests.kv_transfer.conftest import make_side


def _copy(src: torch.Tensor, dst: torch.Tensor, src_ids, dst_ids, layers) -> int:
    return copy_blocks(dst, src.data_ptr(), src.shape[2], tuple(src_ids), tuple(dst_ids), layers)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [
        ([9, 2, 14, 0], [3, 11, 1, 7]),  # unordered, every block its own run
        (list(range(3, 11)), list(range(20, 28))),  # one run on both sides
        ([9, 10, 11, 2, 3], [1, 2, 3, 12, 13]),  # runs that pair up
        ([4, 5, 6, 7], [1, 2, 9, 10]),  # one run at the source, two at the destination
    ],
    ids=["unordered", "one-run", "paired-runs", "split-run"],
)
def test_copy_blocks_moves_exactly_the_blocks_of_the_layers_and_hashes_what_landed(
    src_ids, dst_ids
) -> None:
    src, dst = make_side(32, seed=1), make_side(40)
    digest = _copy(src.kv, dst.kv, src_ids, dst_ids, (1, 3))
    want = torch.zeros_like(dst.kv)
    want[1:3, :, dst_ids] = src.kv[1:3, :, src_ids]
    assert torch.equal(dst.kv, want)  # nothing else: other layers, other blocks untouched
    assert digest == checksum_blocks(dst.kv, dst_ids, (1, 3))
    assert digest == checksum_blocks(src.kv, src_ids, (1, 3))  # what the sender declares


def test_copy_blocks_between_caches_of_different_sizes() -> None:
    # A peer's cache has its own number of blocks: offsets follow each side's.
    src, dst = make_side(5, seed=2), make_side(50)
    digest = _copy(src.kv, dst.kv, [4, 0], [40, 7], (0, 4))
    assert torch.equal(dst.kv[:, :, [40, 7]], src.kv[:, :, [4, 0]])
    assert digest == checksum_blocks(src.kv, [4, 0], (0, 4))


@pytest.mark.parametrize(
    "ids", [[0, 1, 2, 3], [5, 6, 1, 2, 9], [7, 3, 4, 0], [2]], ids=["one-run", "three", "four", "1"]
)
@pytest.mark.parametrize("layers", [(0, 4), (1, 3), (2, 3)])
def test_checksum_blocks_is_xxh3_of_the_layers_digests_and_sees_one_value(ids, layers) -> None:
    kv = torch.randn(4, 2, 11, 16, 2, 8)
    per_layer = [  # each layer's K then V blocks, in request order
        xxhash.xxh3_64_intdigest(as_bytes(kv[layer][:, ids].contiguous()))
        for layer in range(*layers)
    ]
    want = xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in per_layer))
    assert checksum_blocks(kv, ids, layers) == want
    # A cache the engine did not allocate (not contiguous) is hashed from copies, alike.
    strided = torch.randn(4, 2, 11, 16, 2, 16)[..., ::2]
    strided.copy_(kv)
    assert not strided.is_contiguous() and checksum_blocks(strided, ids, layers) == want
    changed = kv.clone()
    changed[layers[0], 1, ids[-1], 3, 1, 7] += 1  # one value of the last block's V
    assert checksum_blocks(changed, ids, layers) != checksum_blocks(kv, ids, layers)
    flipped = kv.clone()
    flipped.view(torch.int32)[layers[0], 0, ids[0], 0, 0, 0] ^= 1  # one bit
    assert checksum_blocks(flipped, ids, layers) != checksum_blocks(kv, ids, layers)


def test_header_round_trip() -> None:
    src = make_side(8, seed=3)
    h = make_header("req-7", (2, 4), (1, 2), (6, 0), src.kv, first_token=42, final=True)
    assert h.nbytes == 2 * 2 * 2 * 16 * 2 * 8 * 4 and h.shape == (2, 2, 2, 16, 2, 8)
    assert h.checksum == checksum_blocks(src.kv, (1, 2), (2, 4))
    assert decode_header(encode_header(h)) == h
    check_fits(h, make_side(8).kv)


def test_empty_final_header_round_trip() -> None:
    h = make_header("r", (4, 4), (1,), (2,), make_side(4).kv, first_token=5, final=True)
    assert h.nbytes == 0 and h.shape == ()
    assert decode_header(encode_header(h)) == h


def test_a_header_with_the_old_extra_field_is_refused() -> None:
    # Protocol 2 appended the sampler's RNG state; a header of that shape is not ours.
    h = make_header("r", (4, 4), (1,), (2,), make_side(4).kv, 5, final=True)
    body = json.loads(encode_header(h))
    with pytest.raises(HeaderError, match="bad magic or field count"):
        decode_header(json.dumps([*body, None]).encode())


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
    h = make_header("r", (2, 4), (1, 2), (6, 0), make_side(8, seed=5).kv)
    with pytest.raises(HeaderError, match=message):
        decode_header(encode_header(dataclasses.replace(h, **change)))


def test_decode_rejects_garbage() -> None:
    with pytest.raises(HeaderError):
        decode_header(b"\xff\x00")
    with pytest.raises(HeaderError, match="magic"):
        decode_header(b'["nope"]')


def test_check_fits_rejects_foreign_layouts() -> None:
    h = make_header("r", (0, 4), (1,), (9,), make_side(8, seed=6).kv)
    with pytest.raises(HeaderError, match="outside the pool"):
        check_fits(h, make_side(8).kv)  # block 8 is the null block, 9 is past it
    with pytest.raises(HeaderError, match="past 2 layers"):
        check_fits(h, make_side(16, layers=2).kv)
    with pytest.raises(HeaderError, match="dtype"):
        check_fits(dataclasses.replace(h, dst_block_ids=(1,)), make_side(8).kv.half())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_blocks(dtype: torch.dtype) -> None:
    src, dst = make_side(8, seed=7), make_side(8)
    src.kv, dst.kv = src.kv.to(dtype), dst.kv.to(dtype)
    h = make_header("r", (0, 4), (3, 1), (0, 2), src.kv)
    assert decode_header(encode_header(h)) == h and h.nbytes == 2 * 4 * 2 * 16 * 2 * 8 * 2
    check_fits(h, dst.kv)
    assert _copy(src.kv, dst.kv, [3, 1], [0, 2], (0, 4)) == h.checksum
    assert torch.equal(dst.kv[:, :, [0, 2]], src.kv[:, :, [3, 1]])


def test_paired_runs_cover_both_lists_in_order() -> None:
    src, dst = [4, 5, 6, 9, 10, 2], [0, 1, 7, 8, 9, 3]
    runs = paired_runs(src, dst)
    assert runs == [(4, 0, 2), (6, 7, 1), (9, 8, 2), (2, 3, 1)]
    assert [s + i for s, _, n in runs for i in range(n)] == src
    assert [d + i for _, d, n in runs for i in range(n)] == dst
