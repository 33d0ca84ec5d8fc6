"""The small steps of a decode step in C (tandem/kernels/cpu/step_ops.c): RoPE, the
KV store into a float cache, and the greedy argmax, each against torch's ops, to the
bit."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.rope import apply_rope, signed_sin
from tandem.kernels import torch_ref
from tandem.kernels.cpu import step_ops
from tests.kernels.conftest import cpu_backend_or_skip


@pytest.fixture
def cpu():
    return cpu_backend_or_skip()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, but for a NaN's (torch's vectorized bfloat16 rounding makes every
    NaN 0xffff, its scalar one 0x7fc0: the same value either way)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _specials(t: torch.Tensor) -> None:
    """NaN, infinities and a negative zero at the start of ``t``."""
    values = [float("nan"), float("inf"), float("-inf"), -0.0, 3e38]
    t.view(-1)[: len(values)] = torch.tensor(values, dtype=t.dtype)


# tokens, q and k heads, head_dim (halves that are and are not multiples of 16)
@pytest.mark.parametrize("tokens,heads,dim", [(1, 12, 64), (16, 12, 64), (7, 5, 48), (3, 2, 10)])
def test_rope_is_torchs_bit_for_bit_on_a_fused_projections_heads(cpu, tokens, heads, dim) -> None:
    gen = torch.Generator().manual_seed(dim + tokens)
    # q and k heads as a view of a fused QKV projection's rows: a token stride longer
    # than the heads it holds.
    fused = (torch.randn(tokens, heads + 3, dim, generator=gen) * 8).bfloat16()
    _specials(fused)
    x = fused[:, :heads]
    angles = torch.rand(tokens, dim, generator=gen) * 100
    cos, sin = angles.cos().bfloat16(), signed_sin(angles.sin()).bfloat16()
    ours = step_ops.rope(x, cos, sin)
    assert ours is not None and ours.is_contiguous()
    assert _same(ours, apply_rope(x, cos, sin))


def test_rope_leaves_what_it_does_not_read_to_torch(cpu) -> None:
    x, cos = torch.randn(2, 3, 8), torch.randn(2, 8)
    assert step_ops.rope(x, cos, cos) is None  # float32: Hugging Face parity
    x, cos = x.bfloat16(), cos.bfloat16()
    assert step_ops.rope(x.transpose(0, 1), cos[:1].expand(3, 8), cos[:1].expand(3, 8)) is None
    assert step_ops.rope(x[..., :7], cos[:, :7], cos[:, :7]) is None  # an odd head_dim
    assert step_ops.rope(x, cos[:1], cos[:1]) is None  # one table row for two tokens
    assert step_ops.rope(x, cos, cos.float()) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_copies_rows_with_token_strides_as_torch_does(cpu, dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 4 + 2 * 2, 16, generator=gen).to(dtype)  # 4 q heads, 2 kv heads
    k, v = qkv[:, 4:6], qkv[:, 6:]
    caches = [torch.randn(6, 4, 2, 16, generator=gen).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    slots = torch.tensor([23, 0, 7, 8, 17])
    torch_ref.store_kv(k, v, *want, slots)
    assert cpu._store_rows(k, v, *caches, slots)  # the C copy, not the reference's
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(caches, want, strict=True))


def test_store_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(cpu) -> None:
    k = torch.randn(3, 2, 16).bfloat16()
    caches = [torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    for bad in (8, -1):
        with pytest.raises(IndexError, match="outside the cache's 8"):
            cpu.store_kv(k, k, *caches, torch.tensor([1, 2, bad]))
        assert not any(c.any() for c in caches)
    # A V cache of another dtype: the reference's copy, which casts.
    assert not cpu._store_rows(k, k, caches[0], caches[1].float(), torch.tensor([0, 1, 2]))
    # Heads that do not lie one after another in a token's row: the reference's copy.
    strided = torch.randn(2, 16, 3).bfloat16().transpose(1, 2)[:, :2]
    assert not cpu._store_rows(strided, strided, *caches, torch.tensor([0, 1]))
    cpu.store_kv(strided, strided, *caches, torch.tensor([0, 1]))
    assert torch.equal(caches[0][0, :2], strided)


@pytest.mark.parametrize("vocab", [1, 5, 16, 33, 49152])
def test_argmax_is_the_first_maximum_or_the_first_nan_as_torchs_max(cpu, vocab) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randn(8, vocab, generator=gen).round()  # rounded: ties to break
    rows[1] = float("-inf")
    rows[2] = 0.0
    rows[2, vocab // 2] = -0.0
    rows[3, vocab - 1] = float("nan")
    rows[4, 0] = float("nan")
    rows[5, -1] = float("inf")
    rows[6, vocab // 3] = float("nan")
    rows[6, vocab // 2 :] = float("nan")
    want = rows.max(dim=-1).indices.tolist()
    assert step_ops.argmax(rows) == want
    assert step_ops.argmax(rows[::3]) == want[::3]  # rows with a stride
    assert step_ops.argmax(rows[:1]) == want[:1]


def test_argmax_leaves_other_dtypes_and_layouts_to_torch(cpu) -> None:
    rows = torch.randn(4, 64)
    assert step_ops.argmax(rows.bfloat16()) is None
    assert step_ops.argmax(rows.t()) is None  # a vocabulary with a stride
    assert step_ops.argmax(rows[0]) is None
    assert step_ops.argmax(rows[:, :0]) is None
