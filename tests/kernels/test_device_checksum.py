"""The checksum of KV blocks on a GPU (tandem/kv_transfer/device_checksum.py), on CPU
tensors here: the torch computation against a plain-Python one written from the
definition, the Triton kernel (interpreted) against the torch computation, and the
properties a transfer relies on."""

from __future__ import annotations

import pytest
import torch

from tandem.kv_transfer import Fingerprint, device_checksum
from tandem.kv_transfer.payload import block_bytes, first_block
from tests.kernels.conftest import triton_backend_or_skip

LAYERS = (0, 3)
IDS = [4, 1, 2, 7]


def _cache(seed: int = 0, blocks: int = 9) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, blocks, 4, 2, 8, generator=gen).to(torch.bfloat16)


def _python_checksum(kv: torch.Tensor, ids: list[int], layers: tuple[int, int]) -> int:
    """The definition, one word at a time: sum of fmix64(word | index << 16) mod 2**64."""
    mask = (1 << 64) - 1

    def fmix64(x: int) -> int:
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & mask
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & mask
        return x ^ (x >> 33)

    words = kv.reshape(-1).view(torch.int16).tolist()
    per_block = block_bytes(kv) // 2
    total, index = 0, 0
    for layer in range(*layers):
        for k_or_v in (0, 1):
            for block in ids:
                start = (first_block(kv.shape[2], layer, k_or_v) + block) * per_block
                for word in words[start : start + per_block]:
                    total = (total + fmix64((word & 0xFFFF) | index << 16)) & mask
                    index += 1
    return total


def _flip(kv: torch.Tensor, layer: int, k_or_v: int, block: int) -> torch.Tensor:
    out = kv.clone()
    out[layer, k_or_v, block].view(-1).view(torch.int16)[3] ^= 1 << 9
    return out


def test_the_torch_computation_follows_the_definition() -> None:
    kv = _cache()
    assert device_checksum.checksum_torch(kv, IDS, LAYERS) == _python_checksum(kv, IDS, LAYERS)
    assert device_checksum.checksum_torch(kv, IDS[:1], (1, 2)) == _python_checksum(
        kv, IDS[:1], (1, 2)
    )


def test_the_triton_kernel_gives_the_torch_value() -> None:
    triton_backend_or_skip()
    for dtype in (torch.bfloat16, torch.float32):
        kv = _cache().to(dtype)
        expected = device_checksum.checksum_torch(kv, IDS, LAYERS)
        assert device_checksum.checksum_triton(kv, IDS, LAYERS) == expected


def test_the_same_bytes_elsewhere_give_the_same_value_and_any_change_another() -> None:
    # The sender hashes its source blocks, the receiver its destination blocks.
    src = _cache()
    dst_ids = [0, 8, 3, 5]
    dst = _cache(seed=1)
    dst[:, :, dst_ids] = src[:, :, IDS]
    value = device_checksum.checksum_torch(src, IDS, LAYERS)
    assert device_checksum.checksum_torch(dst, dst_ids, LAYERS) == value

    for layer, k_or_v, i in [(0, 0, 0), (2, 1, 3), (1, 1, 2)]:
        flipped = _flip(dst, layer, k_or_v, dst_ids[i])
        assert device_checksum.checksum_torch(flipped, dst_ids, LAYERS) != value
    outside = _flip(dst, 0, 0, 6)  # a block the message does not cover
    assert device_checksum.checksum_torch(outside, dst_ids, LAYERS) == value
    swapped = [dst_ids[1], dst_ids[0], *dst_ids[2:]]  # the right bytes, the wrong order
    assert device_checksum.checksum_torch(dst, swapped, LAYERS) != value


def test_the_fingerprint_names_the_checksum_so_host_and_gpu_caches_refuse_each_other() -> None:
    assert device_checksum.algorithm_for("cpu") == "xxh3_64-layers"
    assert device_checksum.algorithm_for("cuda:1") == "fmix64-sum"
    geometry = {"model": "m", "dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 1}
    host = Fingerprint(**geometry, head_dim=8, block_size=4)
    gpu = Fingerprint(**geometry, head_dim=8, block_size=4, checksum="fmix64-sum")
    assert host.mismatches(gpu) == "checksum: prefill xxh3_64-layers, decode fmix64-sum"
    assert Fingerprint.from_dict(host.to_dict()) == host
    # A peer that predates the field sends none: it hashed a message with one xxh3_64,
    # which a per-layer checksum never equals, so the two refuse each other by name.
    older = Fingerprint.from_dict({k: v for k, v in host.to_dict().items() if k != "checksum"})
    assert host.mismatches(older) == "checksum: prefill xxh3_64-layers, decode xxh3_64"


def test_an_odd_block_is_refused() -> None:
    kv = torch.zeros(1, 2, 3, 1, 1, 1, dtype=torch.float8_e4m3fn)  # 1 byte per block
    with pytest.raises(ValueError, match="not a whole number of 16-bit words"):
        device_checksum.checksum_torch(kv, [0], (0, 1))
