"""The engine's Linear and RMSNorm against torch's and Hugging Face's own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tandem.engine.model import Linear, LlamaModel, RMSNorm
from tests.engine.factories import tiny_config


def _pair(bias: bool, dtype: torch.dtype) -> tuple[Linear, nn.Linear]:
    torch.manual_seed(0)
    ours = Linear(64, 96, bias=bias).to(dtype)
    ref = nn.Linear(64, 96, bias=bias).to(dtype)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


@pytest.mark.parametrize("rows", [1, 3, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_float32_matches_nn_linear(rows, bias):
    ours, ref = _pair(bias, torch.float32)
    assert ours.pack()
    x = torch.randn(rows, 64)
    out = ours(x)
    assert out.is_contiguous()
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bfloat16_matches_nn_linear(rows, bias):
    ours, ref = _pair(bias, torch.bfloat16)
    if not ours.pack():
        pytest.skip("this CPU's oneDNN does not compute in bfloat16")
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    if bias:  # the bias is added before the one rounding to bfloat16, not after
        torch.testing.assert_close(ours(x), ref(x), rtol=1.6e-2, atol=1e-2)
    else:
        assert torch.equal(ours(x), ref(x))


def test_packing_replaces_the_dense_weight_unless_asked_to_keep_it():
    dropped, _ = _pair(False, torch.float32)
    kept, _ = _pair(False, torch.float32)
    assert dropped.pack() and kept.pack(keep_dense=True)
    assert dropped.weight is None and dropped.packed is not None
    assert kept.weight is not None


def test_unpacked_linear_is_nn_linear():
    ours, ref = _pair(True, torch.float32)
    x = torch.randn(5, 64)
    assert torch.equal(ours(x), ref(x))


def test_pack_for_cpu_keeps_a_tied_lm_head_shared_with_the_embedding():
    model = LlamaModel(dataclasses.replace(tiny_config(), tie_word_embeddings=True), 64)
    assert model.pack_for_cpu()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].mlp.down_proj.weight is None
    hidden = torch.randn(3, model.cfg.hidden_size)
    torch.testing.assert_close(
        model.logits(hidden), hidden @ model.embed_tokens.weight.T, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_is_bit_identical_to_hf(dtype, rows):
    torch.manual_seed(1)
    ours, ref = RMSNorm(64, 1e-5), LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64))
        ref.weight.copy_(ours.weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (torch.randn(rows, 64) * 3).to(dtype)
    assert torch.equal(ours(x), ref(x))


def _hf_norm(dim: int, seed: int) -> LlamaRMSNorm:
    torch.manual_seed(seed)
    ref = LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(dim))
    return ref.bfloat16()


@pytest.mark.parametrize("dim", [576, 1000])
def test_the_fused_bfloat16_norm_is_hfs_but_for_rare_one_unit_differences(dim):
    # rms_norm.c sums the squares in another order than torch: an output within a
    # float32 rounding of a bfloat16 tie can move by one unit (measured: none of 300
    # rows of 576, 8e-5 of the values at 1000), never more.
    from tandem.kernels.cpu import norm

    ref = _hf_norm(dim, seed=dim)
    ours = RMSNorm(dim, 1e-5).bfloat16()
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(300, dim, generator=gen) * 3).bfloat16()
    out = torch.randn(300, dim, generator=gen).bfloat16()
    assert norm.rms_norm(x, ours.weight, 1e-5) is not None  # the kernel, not torch's ops
    h, y = ours.add(x, out)
    assert torch.equal(h, x + out)  # the residual add is exact
    want = ref(x + out)
    units = (y.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert units.max() <= 1 and (units > 0).float().mean() <= 1e-3
    assert torch.equal(ours(x), norm.rms_norm(x, ours.weight, 1e-5)[1])  # no residual


def test_the_fused_norm_leaves_float32_and_odd_shapes_to_torch():
    from tandem.kernels.cpu import norm

    w = torch.randn(64)
    assert norm.rms_norm(torch.randn(3, 64), w, 1e-5) is None  # float32: HF parity
    assert norm.rms_norm(torch.randn(2, 3, 64).bfloat16(), w.bfloat16(), 1e-5) is None
    ours = RMSNorm(64, 1e-5)
    h, y = ours.add(torch.ones(2, 64), torch.ones(2, 64))
    assert torch.equal(h, torch.full((2, 64), 2.0)) and torch.allclose(y, torch.ones(2, 64))
