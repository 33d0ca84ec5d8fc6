"""The Triton attention backend: the interface of :mod:`tandem.kernels.torch_ref`.

Each kernel module holds the ``@triton.jit`` kernel and its launcher, which checks
shapes, strides and dtypes. Runs on CUDA tensors, or on CPU tensors under
``TRITON_INTERPRET=1`` (set before this package is first imported; see
``common.INTERPRET``), which is how the tests check it against the reference.
"""

from __future__ import annotations

from tandem.kernels.triton.common import INTERPRET
from tandem.kernels.triton.kv_store import store_kv
from tandem.kernels.triton.paged_decode import decode_attention
from tandem.kernels.triton.paged_prefill import prefill_attention

__all__ = ["INTERPRET", "decode_attention", "prefill_attention", "store_kv"]
