"""Factories for KV transfer tests: block pools with their KV tensors, and a leak check."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tandem.engine.block_manager import BlockPool
from tandem.kv_transfer.base import Fingerprint
from tandem.kv_transfer.ucx.runtime import ucx_env_defaults

# Before ucxx is imported, here and in every process the tests spawn (they
# inherit the environment).
ucx_env_defaults()

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 4, 16, 2, 8


def fingerprint(**overrides) -> Fingerprint:
    values = dict(
        model="tiny-test",
        dtype="float32",
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
    )
    values.update(overrides)
    return Fingerprint(**values)


@dataclass
class Side:
    """One worker's KV: the pool that owns the blocks and the tensor that holds them."""

    pool: BlockPool
    kv: torch.Tensor  # [layers, 2, num_blocks + 1, block_size, kv_heads, head_dim], cpu

    def check_clean(self) -> None:
        self.pool.check_integrity()
        assert self.pool.num_used == 0, f"{self.pool.num_used} KV blocks leaked"
        assert not self.kv[:, :, -1].any(), "the null block was written"


def make_side(
    num_blocks: int = 64, seed: int | None = None, layers: int = LAYERS, ucx: bool = False
) -> Side:
    """Zero KV, or random KV from ``seed`` (reproducible in another process). ``ucx``:
    the cache allocated as a prefill worker's is (UCX shared memory, ucx/rma.py)."""
    shape = (layers, 2, num_blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    if ucx:
        from tandem.kv_transfer.ucx.rma import allocate_kv

        kv = allocate_kv(shape, torch.float32, torch.device("cpu"))
    else:
        kv = torch.zeros(shape)
    if seed is not None:
        kv.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
        kv[:, :, -1] = 0  # the null block is always zero
    return Side(BlockPool(num_blocks, BLOCK_SIZE), kv)


@pytest.fixture
def fp() -> Fingerprint:
    return fingerprint()
