"""Compile every Triton kernel for a GPU architecture, here, with no GPU: Triton's
front end and the ptxas its wheel bundles, as a first launch on that GPU would.

The suite runs the kernels under TRITON_INTERPRET=1, which executes their Python
and never applies Triton's language rules (a kernel reading a global that is not a
constexpr) or a device's limits (shared memory per program). Run without that
variable: ``python tests/kernels/gpu_compile.py [--every] [--only NAME] ARCH...`` prints one JSON
object per variant: its name, the architecture, the shared memory it takes and the
device's limit, or the error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tandem.kernels.triton import kv_store, paged_decode, paged_prefill  # noqa: E402
from tandem.kernels.triton.common import block_d  # noqa: E402
from tandem.kv_transfer import device_checksum  # noqa: E402

# Shared memory per program (opt-in maximum), by compute capability.
SHARED = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}
TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "i8"}


def _compile(fn, arch: int, pointers: dict, constexprs: dict, warps: int, stages: int) -> dict:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name == "scale_log2" else "i32")
    source = ASTSource(fn, signature=signature, constexprs=constexprs)
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    except Exception as exc:  # the finding itself
        return {"error": f"{type(exc).__name__}: {exc}"[:600]}
    return {"shared": kernel.metadata.shared}


def checksum(arch: int) -> dict:
    pointers = {"words": "*i16", "physical": "*i64", "logical": "*i64", "partials": "*i64"}
    constexprs = {"CHUNK": device_checksum._CHUNK, "C1": device_checksum._C1,
                  "C2": device_checksum._C2}  # fmt: skip
    return _compile(device_checksum._kernel(), arch, pointers, constexprs, 4, 3)


def decode(arch: int, dtype, quant: bool, head_dim: int, group: int, split: bool) -> dict:
    cache = TYPE[torch.int8 if quant else dtype]
    partial = "*fp32" if split else f"*{TYPE[dtype]}"
    pointers = {"q_ptr": f"*{TYPE[dtype]}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}",
                "tables_ptr": "*i64", "lens_ptr": "*i64", "out_ptr": f"*{TYPE[dtype]}",
                "part_out_ptr": partial, "part_lse_ptr": partial}  # fmt: skip
    bd = block_d(head_dim)
    constexprs = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16,
                      BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=bd,
                      BLOCK_N=64 if bd <= 128 else 32, SPLIT=split,
                      WIDEN=dtype == torch.float32, QUANT=quant)  # fmt: skip
    return _compile(paged_decode._decode_kernel, arch, pointers, constexprs, 4, 2)


def merge(arch: int, dtype, head_dim: int, splits: int) -> dict:
    pointers = {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{TYPE[dtype]}"}
    bd = block_d(head_dim)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=bd, BLOCK_S=triton.next_power_of_2(splits))
    return _compile(paged_decode._merge_kernel, arch, pointers, constexprs,
                    4 if bd >= 128 else 1, 3)  # fmt: skip


def prefill(arch: int, dtype, quant: bool, head_dim: int, group: int, query_len: int) -> dict:
    bm, bn, warps, stages = paged_prefill.default_tiles(head_dim, query_len, dtype, SHARED[arch])
    cache = TYPE[torch.int8 if quant else dtype]
    pointers = {"q_ptr": f"*{TYPE[dtype]}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}",
                "table_ptr": "*i64", "out_ptr": f"*{TYPE[dtype]}",
                "new_k_ptr": f"*{TYPE[dtype]}", "new_v_ptr": f"*{TYPE[dtype]}"}  # fmt: skip
    constexprs = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=16, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_D=block_d(head_dim), WIDEN=dtype == torch.float32, QUANT=quant,
                      NEW=quant)  # fmt: skip
    return _compile(paged_prefill._prefill_kernel, arch, pointers, constexprs, warps, stages)


def store(arch: int, dtype, quant: bool, head_dim: int, kv_heads: int) -> dict:
    cache = TYPE[torch.int8 if quant else dtype]
    rows = TYPE[torch.float32 if quant else dtype]
    pointers = {"k_ptr": f"*{rows}", "v_ptr": f"*{rows}", "k_cache_ptr": f"*{cache}",
                "v_cache_ptr": f"*{cache}", "slot_ptr": "*i64"}  # fmt: skip
    constexprs = dict(KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=16,
                      BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=block_d(head_dim),
                      QUANT=quant)  # fmt: skip
    return _compile(kv_store._store_kv_kernel, arch, pointers, constexprs,
                    1 if kv_heads * head_dim <= 512 else 4, 3)  # fmt: skip


def variants(arch: int, every: bool):
    """(name, thunk) for the variants the launchers pick: bfloat16 (and float16 with
    ``every``), float and int8 caches, head_dim 64 and 128 (and a prefill of 256); with
    ``every`` also a short prefill (its own tiles) and the store of 64-wide heads."""
    dtypes = (torch.bfloat16, torch.float16) if every else (torch.bfloat16,)
    yield "checksum", lambda: checksum(arch)
    for dtype in dtypes:
        for quant in (False, True):
            for head_dim in (64, 128):
                name = f"{TYPE[dtype]} {'int8' if quant else 'float'} cache, head_dim {head_dim}"
                yield (
                    f"decode, {name}",
                    lambda d=dtype, q=quant, h=head_dim: decode(arch, d, q, h, 4, split=q),
                )
                for n in (16, 512) if every else (512,):
                    yield (
                        f"prefill of {n}, {name}",
                        (lambda d=dtype, q=quant, h=head_dim, n=n: prefill(arch, d, q, h, 4, n)),
                    )
                if every or head_dim == 128:
                    yield (
                        f"store, {name}",
                        lambda d=dtype, q=quant, h=head_dim: store(arch, d, q, h, 8),
                    )
        yield f"merge, {TYPE[dtype]}", lambda d=dtype: merge(arch, d, 128, 8)
        for n in (16, 512):  # the widest heads, with tiles of their own
            yield (
                f"prefill of {n}, {TYPE[dtype]} float cache, head_dim 256",
                (lambda d=dtype, n=n: prefill(arch, d, False, 256, 4, n)),
            )


def main(archs: list[int], every: bool, only: str) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compile, do not interpret"
    for arch in archs:
        for name, thunk in variants(arch, every):
            if only not in name:
                continue
            print(json.dumps({"name": name, "arch": arch, "limit": SHARED[arch], **thunk()}),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("archs", nargs="*", type=int, default=[90], help="compute capabilities")
    p.add_argument("--every", action="store_true", help="float16 and short prefills too")
    p.add_argument("--only", default="", help="the variants whose name holds this")
    args = p.parse_args()
    main(args.archs, args.every, args.only)
