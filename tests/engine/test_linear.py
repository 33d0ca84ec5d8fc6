"""The engine's Linear: the same values as nn.Linear whichever form it computes in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.engine.model import TRANSPOSED_MAX_ROWS, Linear


@pytest.mark.parametrize("rows", [1, 3, 16, TRANSPOSED_MAX_ROWS, TRANSPOSED_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_nn_linear(rows, bias):
    torch.manual_seed(0)
    ours = Linear(64, 96, bias=bias)
    ref = nn.Linear(64, 96, bias=bias)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(rows, 64)
    out = ours(x)
    assert out.is_contiguous()  # a transposed activation would slow the next projection
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-5)


def test_other_dtypes_take_nn_linear():
    layer = Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
