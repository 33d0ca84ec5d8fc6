"""A GGUF's 4-bit projections, run as stored for the steps of a few rows on a CPU.

The default model's GGUF stores every projection as Q4_1: along each row, groups of
32 weights ``q * d + m`` (q in 0..15, d and m float16). The engine's dense weights are
those values dequantised, then cast to the model dtype; a decode step of one or a few
rows is bound by reading them (the default model's layers: 212 MB of bfloat16 a step).
torch's int4 weight-only matmul for CPU (``_weight_int4pack_mm_for_cpu``) reads the
4-bit codes instead, a quarter of the bytes. It computes ``(q - 8) * scale + zero``
with scale and zero in the activations' dtype, so in bfloat16 ``d`` and ``m + 8d``
are rounded to bfloat16: against exact weights, a projection's error is about 1.2x
that of the dense bfloat16 weights (tests/engine/test_gguf_int4.py checks it stays
under 1.5x), both well under what bfloat16 rounding of the output adds.

On a CPU with AMX (Intel Xeon since Sapphire Rapids), steps of 4 to 64 rows run
tandem/kernels/cpu/gguf_linear.c instead: it expands each group of 16 rows' codes to
bfloat16 once a step, exactly the dense weights (checked at load), and multiplies them
with every row of the step on the AMX tiles, so a step of 16 rows reads the codes
once where torch's kernel expands them again for every row. The same kernel reads
the LM head's 8-bit codes (Q8_0: ``q * d``, the default model's token embedding,
which it ties to the head) for steps of 1 to 64 rows, there being no other form of
them.

In float32 (a CPU without native bfloat16, where ``dtype: auto`` is float32) a step
of one row reads 4 bytes a weight from the dense weights. Steps of up to
``F32_MAX_ROWS`` rows (16, or 8 with AVX-512; 0 on an x86 CPU without AVX2, where
the dense weights win) run tandem/kernels/cpu/codes_f32.c instead, which reads the
codes (0.75 bytes a weight for Q4_1, 1.125 for the Q8_0 head) and expands each group
in registers to exactly the dense float32 weights (checked at load).

Where each pays (``python bench/linear_forms.py``): on CPU, in bfloat16, steps of at
most ``int4_max_rows`` rows read the codes (torch's kernel up to 8 rows, where it
stops beating the dense weights; the AMX kernel from 4 to 64); larger steps (prefill
chunks, big decode batches) keep the dense prepacked weights, which stay loaded
beside the codes (+25% weight memory for each form of the codes).
A tensor gets codes only when they dequantise to exactly the weights the engine
loaded, so a GGUF whose layout this reader does not know is run dense, not wrong.
Reading, checking and packing the codes takes seconds, so the packed result is kept
beside the dequantised weights (one file per torch version and CPU) and read back later.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import xxhash

if TYPE_CHECKING:
    from tandem.engine.model import LlamaModel

log = logging.getLogger(__name__)

GROUP = 32  # Q4_1's weights per scale and minimum
_PACK_ROWS = 16  # torch's int4 packing for CPU and the AMX tiles take rows by 16
# Which kernel a step of n rows runs (bench/linear_forms.py, a VM with AMX, 2 cores):
# torch's is the faster below 4 rows and slower than the dense weights above 8; the
# AMX kernel (gguf_linear.c's CODES_MAX_ROWS) holds up to 64.
TORCH_MAX_ROWS = 8
AMX_MIN_ROWS, AMX_MAX_ROWS = 4, 64
F32_KERNEL_MAX_ROWS = 16  # codes_f32.c's CODES_F32_MAX_ROWS


def _f32_max_rows() -> int:
    """float32 steps of at most this many rows read the codes (codes_f32.c). Against
    the dense weights prepacked for oneDNN, over all 30 layers' projections of the
    default model (bench/linear_forms.py --dtypes float32, an Intel VM whose L3 holds
    the dense weights): with oneDNN's AVX-512 kernels 4.1x faster at 1 row, 2.0x at
    8, 1.0x at 16; with oneDNN and MKL held to AVX2 (ONEDNN_MAX_CPU_ISA,
    MKL_ENABLE_INSTRUCTIONS) and the kernel built for Haswell, 4.8x, 2.3x and 1.4x.
    Where the weights stream from memory the codes gain more. An x86 CPU without AVX2
    has none of the kernel's widening loads, and there the dense weights win at every
    size (0.4-0.9x in a one-off run with the kernel built for SSE4 and for AVX): 0."""
    from tandem.kernels.cpu.build import cpu_flags

    flags = cpu_flags().split()
    if "avx512f" in flags:
        return 8
    if "sse2" in flags and "avx2" not in flags:  # x86 (an Arm CPU lists neither)
        return 0
    return F32_KERNEL_MAX_ROWS


F32_MAX_ROWS = _f32_max_rows()
# Bump when what the cache file holds, or how it is made, changes.
_CACHE_FORMAT = 4
_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of two 4-bit codes each
# GGUF tensor -> Hugging Face parameter, per layer.
_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The engine's fused projections and the parts they are stacked from, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class Q4_1(NamedTuple):
    codes: torch.Tensor  # [rows, cols] uint8, 0..15
    scales: torch.Tensor  # [rows, cols / GROUP] float32 (float16 values)
    mins: torch.Tensor  # [rows, cols / GROUP] float32

    def dequantize(self) -> torch.Tensor:
        """[rows, cols] float32: ``d * q + m``, as gguf (and so the engine's loader) does."""
        rows, cols = self.codes.shape
        q = self.codes.view(rows, cols // GROUP, GROUP).float()
        return (self.scales[..., None] * q + self.mins[..., None]).view(rows, cols)

    @staticmethod
    def cat(parts: list[Q4_1]) -> Q4_1:
        return Q4_1(*(torch.cat(field) for field in zip(*parts, strict=True)))


def read_q4_1(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, Q4_1]:
    """The Q4_1 projections of a GGUF file by Hugging Face name (other tensors left out).

    llama.cpp stores q and k with each head's rows interleaved for its RoPE; they are
    put back in Hugging Face's order, as transformers' GGUF loader does."""
    from gguf import GGMLQuantizationType, GGUFReader

    out = {}
    for tensor in GGUFReader(str(path)).tensors:
        parts = tensor.name.split(".")  # blk.{i}.{kind}.weight
        if (
            len(parts) != 4
            or parts[0] != "blk"
            or parts[2] not in _NAMES
            or tensor.tensor_type != GGMLQuantizationType.Q4_1
        ):
            continue
        q = _decode_blocks(np.asarray(tensor.data))
        if parts[2] in ("attn_q", "attn_k"):
            heads = num_heads if parts[2] == "attn_q" else num_kv_heads
            q = Q4_1(*(field[_rope_rows(q.codes.shape[0], heads)] for field in q))
        out[f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.weight"] = q
    return out


def _decode_blocks(raw: np.ndarray) -> Q4_1:
    """[rows, blocks * 20] uint8 -> codes, scales, minimums (the low nibbles of a
    block's 16 bytes are its first 16 weights, the high nibbles the next 16)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, _BLOCK_BYTES)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]
    codes = np.concatenate([packed & 0xF, packed >> 4], axis=-1).reshape(rows, -1)
    return Q4_1(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(mins))


def _rope_rows(rows: int, heads: int) -> np.ndarray:
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def matching_codes(model: LlamaModel, tensors: dict[str, Q4_1]) -> dict[str, Q4_1]:
    """The engine's projection -> its codes, for each projection whose codes dequantise
    to exactly the float32 weights loaded into ``model`` (call before any dtype cast)."""
    found, mismatched = {}, []
    for i, layer in enumerate(model.layers):
        for fused, part_names in _FUSED.items():
            parts = [tensors.get(f"model.layers.{i}.{name}.weight") for name in part_names]
            if any(p is None for p in parts):
                continue
            codes = Q4_1.cat(parts)
            name = f"layers.{i}.{fused}"
            if codes.codes.shape[0] % _PACK_ROWS:
                continue  # torch's packing takes whole tiles of rows: dense weights only
            if torch.equal(codes.dequantize(), layer.get_submodule(fused).weight.float()):
                found[name] = codes
            else:
                mismatched.append(name)
    if mismatched:
        log.warning(
            "%d projections' 4-bit codes do not give the loaded weights (e.g. %s): "
            "those run on dense weights only",
            len(mismatched),
            mismatched[0],
        )
    return found


class Forms(NamedTuple):
    """A projection's codes in the forms its kernels read."""

    # torch's _weight_int4pack_mm_for_cpu (Q4_1 only; None for the Q8_0 head): its
    # packing, and [groups, rows, 2] scale and zero in the activations' dtype (zero =
    # m + 8d, since it centres q on 8).
    packed: torch.Tensor | None
    scales_and_zeros: torch.Tensor | None
    # gguf_linear.c's, where it runs (None elsewhere), by groups of 16 rows and 32
    # columns: Q4_1 uint8 [rows/16, cols/32, 16, 16] codes, two a byte as in the GGUF,
    # and float16 [rows/16, cols/32, 32], the 16 rows' d then m; Q8_0 int8 [rows/16,
    # cols/32, 16, 32] codes and float16 [rows/16, cols/32, 16], the rows' d.
    tiles: torch.Tensor | None = None
    tile_scales: torch.Tensor | None = None
    # codes_f32.c's, for float32 steps (the only form there): Q4_1 uint8 [rows, cols/2]
    # codes, a group's 16 bytes as in the GGUF, and float32 [rows, cols/32, 2], d and
    # m; Q8_0 int8 [rows, cols] codes and float32 [rows, cols/32], d.
    f32_codes: torch.Tensor | None = None
    f32_scales: torch.Tensor | None = None

    @property
    def tile_format(self) -> str:
        assert self.tiles is not None
        return "q8" if self.tiles.shape[-1] == GROUP else "q4"

    @property
    def f32_format(self) -> int:
        """codes_f32.c's format: 0 Q4_1, 1 Q8_0."""
        assert self.f32_scales is not None
        return 0 if self.f32_scales.dim() == 3 else 1


def pack(codes: Q4_1, dtype: torch.dtype, amx: bool = False) -> Forms:
    """``codes`` in the forms that steps in ``dtype`` read (the AMX kernel's too if
    ``amx``: bfloat16 only; float32 steps read codes_f32.c's form only)."""
    if dtype == torch.float32:
        rows, cols = codes.codes.shape
        q = codes.codes.view(rows, cols // GROUP, 2, GROUP // 2)
        packed_codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(rows, cols // 2)
        scales = torch.stack([codes.scales, codes.mins], dim=-1).contiguous()
        return Forms(None, None, f32_codes=packed_codes.contiguous(), f32_scales=scales)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32), 2)
    zeros = codes.mins + 8 * codes.scales
    scales_and_zeros = torch.stack([codes.scales.t(), zeros.t()], dim=-1)  # [groups, rows, 2]
    forms = Forms(packed, scales_and_zeros.to(dtype).contiguous())
    if not amx or dtype != torch.bfloat16:
        return forms
    rows, cols = codes.codes.shape
    q = codes.codes.view(rows // 16, 16, cols // GROUP, 2, GROUP // 2)
    tiles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    d, m = (t.half().view(rows // 16, 16, cols // GROUP).transpose(1, 2) for t in codes[1:])
    return forms._replace(tiles=tiles, tile_scales=torch.cat([d, m], dim=-1).contiguous())


class Q8_0(NamedTuple):
    codes: torch.Tensor  # [rows, cols] int8
    scales: torch.Tensor  # [rows, cols / GROUP] float32 (float16 values)

    def dequantize(self) -> torch.Tensor:
        """[rows, cols] float32: ``d * q``, as gguf does."""
        rows, cols = self.codes.shape
        q = self.codes.view(rows, cols // GROUP, GROUP).float()
        return (self.scales[..., None] * q).view(rows, cols)


def read_q8_0_head(path: Path, tied: bool) -> Q8_0 | None:
    """The LM head's Q8_0 codes: ``output.weight``, or with tied embeddings the token
    embedding's (the default model's); None if the GGUF stores it otherwise."""
    from gguf import GGMLQuantizationType, GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    head = tensors.get("output.weight") or (tensors.get("token_embd.weight") if tied else None)
    if head is None or head.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    raw = np.asarray(head.data)
    blocks = raw.reshape(raw.shape[0], -1, 2 + GROUP)  # float16 d, 32 int8 codes
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return Q8_0(torch.from_numpy(codes), torch.from_numpy(scales))


def pack_q8_0(head: Q8_0, dtype: torch.dtype = torch.bfloat16) -> Forms:
    """The LM head's codes as the AMX kernel's tiles (bfloat16), or codes_f32.c's
    form (float32)."""
    if dtype == torch.float32:
        return Forms(None, None, f32_codes=head.codes.contiguous(), f32_scales=head.scales)
    rows, cols = head.codes.shape
    tiles = head.codes.view(rows // 16, 16, cols // GROUP, GROUP).transpose(1, 2).contiguous()
    d = head.scales.half().view(rows // 16, 16, cols // GROUP).transpose(1, 2).contiguous()
    return Forms(None, None, tiles, d)


Packed = dict[str, Forms]  # projection -> its codes' forms


class _AMX:
    """gguf_linear.c's entry points, from the CPU kernels' library (built on first use)."""

    def __init__(self) -> None:
        self.ready = False
        from tandem.kernels.cpu.build import load

        lib = load()
        if lib is None:
            return
        i32, ptr = ctypes.c_int, ctypes.c_void_p
        self.linear, self.dequant = {}, {}
        for fmt in ("q4", "q8"):
            self.linear[fmt] = getattr(lib, f"tandem_{fmt}_linear_bf16")
            self.linear[fmt].argtypes = [ptr, i32, i32, ptr, ptr, ptr, ptr, i32, i32]
            self.dequant[fmt] = getattr(lib, f"tandem_{fmt}_dequant_bf16")
            self.dequant[fmt].argtypes = [ptr, ptr, i32, i32, ptr]
        self.ready = lib.tandem_codes_amx_ready() == 1


_amx: _AMX | None = None


def _kernel() -> _AMX:
    global _amx
    if _amx is None:
        _amx = _AMX()
    return _amx


def amx_available() -> bool:
    """True where the AMX kernel runs: built for this CPU, and Linux grants AMX."""
    return _kernel().ready


def amx_weights(forms: Forms) -> torch.Tensor:
    """[rows, cols] bfloat16: the weights the AMX kernel computes with."""
    assert forms.tiles is not None and forms.tile_scales is not None
    blocks, groups = forms.tiles.shape[:2]
    w = torch.empty(blocks * 16, groups * GROUP, dtype=torch.bfloat16)
    status = _kernel().dequant[forms.tile_format](
        forms.tiles.data_ptr(), forms.tile_scales.data_ptr(), w.shape[0], w.shape[1], w.data_ptr()
    )
    if status != 0:
        raise RuntimeError(f"the AMX kernel failed (status {status})")
    return w


def amx_linear(x: torch.Tensor, forms: Forms, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a bfloat16 ``x`` of 1..AMX_MAX_ROWS rows, W read from
    ``forms``' tiles."""
    assert forms.tiles is not None and forms.tile_scales is not None
    blocks, groups = forms.tiles.shape[:2]
    rows, out_features = x.shape[0], blocks * 16
    # The kernel trusts its shapes.
    if x.dim() != 2 or x.shape[1] != groups * GROUP or x.dtype != torch.bfloat16:
        raise ValueError(f"amx_linear: x {tuple(x.shape)} {x.dtype} for {out_features} rows")
    if bias is not None:
        if bias.shape != (out_features,) or bias.dtype != torch.bfloat16:
            raise ValueError(f"amx_linear: bias {tuple(bias.shape)} {bias.dtype}")
        bias = bias.contiguous()
    x = x.contiguous()
    y = torch.empty(rows, out_features, dtype=torch.bfloat16)
    status = _kernel().linear[forms.tile_format](
        x.data_ptr(),
        rows,
        x.shape[1],
        forms.tiles.data_ptr(),
        forms.tile_scales.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        out_features,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"the AMX kernel failed (status {status})")
    return y


# codes_f32.c's entry points, in the CPU kernels' library (built on first use).
_F32_LINEAR = ("tandem_codes_linear_f32", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
               ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int])  # fmt: skip
_F32_DEQUANT = ("tandem_codes_dequant_f32", [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_int, ctypes.c_int, ctypes.c_void_p])  # fmt: skip


def _f32_kernel(entry: tuple[str, list]):
    from tandem.kernels.cpu.build import function

    return function(*entry)


def f32_available() -> bool:
    """True where codes_f32.c runs: the CPU kernels' library builds here."""
    return _f32_kernel(_F32_LINEAR) is not None


def f32_weights(forms: Forms) -> torch.Tensor:
    """[rows, cols] float32: the weights codes_f32.c computes with."""
    assert forms.f32_codes is not None and forms.f32_scales is not None
    rows, groups = forms.f32_scales.shape[:2]
    w = torch.empty(rows, groups * GROUP)
    status = _f32_kernel(_F32_DEQUANT)(
        forms.f32_format,
        forms.f32_codes.data_ptr(),
        forms.f32_scales.data_ptr(),
        rows,
        groups * GROUP,
        w.data_ptr(),
    )
    if status != 0:
        raise RuntimeError(f"the float32 codes kernel failed (status {status})")
    return w


def f32_linear(x: torch.Tensor, forms: Forms, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a float32 ``x`` of 1..F32_KERNEL_MAX_ROWS rows, W read
    from ``forms``' codes by codes_f32.c."""
    assert forms.f32_codes is not None and forms.f32_scales is not None
    out_features, groups = forms.f32_scales.shape[:2]
    rows = x.shape[0]
    # The kernel trusts its shapes.
    if (
        x.dim() != 2
        or not 1 <= rows <= F32_KERNEL_MAX_ROWS
        or x.shape[1] != groups * GROUP
        or x.dtype != torch.float32
    ):
        raise ValueError(f"f32_linear: x {tuple(x.shape)} {x.dtype} for {out_features} rows")
    if bias is not None:
        if bias.shape != (out_features,) or bias.dtype != torch.float32:
            raise ValueError(f"f32_linear: bias {tuple(bias.shape)} {bias.dtype}")
        bias = bias.contiguous()
    x = x.contiguous()
    y = torch.empty(rows, out_features)
    status = _f32_kernel(_F32_LINEAR)(
        forms.f32_format,
        x.data_ptr(),
        rows,
        x.shape[1],
        forms.f32_codes.data_ptr(),
        forms.f32_scales.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        out_features,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"the float32 codes kernel failed (status {status})")
    return y


def load_packed(model: LlamaModel, gguf: Path, model_dir: Path, dtype: torch.dtype) -> Packed:
    """The packed codes of ``model``'s projections (its float32 weights loaded, not yet
    cast) from ``model_dir``'s cache file, or read from ``gguf``, checked and cached.
    ``dtype``: bfloat16, or float32 where ``f32_available``."""
    from safetensors.torch import save_file

    from tandem.kernels.cpu.build import cpu_flags

    amx = dtype == torch.bfloat16 and amx_available()
    f32 = dtype == torch.float32
    # torch's packed layout may differ by version and by CPU; the AMX tiles are there
    # only where the kernel runs.
    key = f"{_CACHE_FORMAT}|{torch.__version__}|{cpu_flags()}|amx={amx}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cached = model_dir / f"int4-{str(dtype).removeprefix('torch.')}-{digest}.safetensors"
    from tandem.engine.loader import owned_name, remove_abandoned

    # A build killed beside one that completed left its partial file: found here, not
    # only when this start builds again (a start that finds the file never would).
    remove_abandoned(cached.parent, cached.name)
    if cached.is_file():
        try:
            packed = _fitting(model, _load_checked(cached), amx, f32)
            wrong = _wrong_tiles(model, packed)
            if wrong:
                raise ValueError(f"the codes of {wrong[0]} do not expand to its weights")
            return packed
        except Exception as exc:  # safetensors raises its own error type for a bad file
            log.warning("rebuilding %s, which does not fit the model: %s", cached, exc)
    cfg = model.cfg
    codes = matching_codes(model, read_q4_1(gguf, cfg.num_heads, cfg.num_kv_heads))
    packed = {name: pack(c, dtype, amx) for name, c in codes.items()}
    head = read_q8_0_head(gguf, cfg.tie_word_embeddings) if amx or f32 else None
    if head is not None and head.codes.shape[0] % _PACK_ROWS == 0:
        if torch.equal(head.dequantize(), model.lm_head.weight.detach().float()):
            packed["lm_head"] = pack_q8_0(head, dtype)
        else:
            log.warning("the LM head's 8-bit codes do not give its loaded weights: dense only")
    packed = _without_wrong_tiles(model, packed)
    tensors = {
        f"{n}.{part}": t
        for n, forms in packed.items()
        for part, t in forms._asdict().items()
        if t is not None
    }
    partial = cached.with_name(f"{owned_name(cached.name)}.partial")
    try:
        save_file(tensors, str(partial), metadata={"xxh3_128": _digest(tensors)})
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, cached)
    except Exception as exc:  # a read-only cache still serves: the next start reads again
        log.warning("cannot keep the packed 4-bit codes in %s: %s", cached, exc)
    finally:
        partial.unlink(missing_ok=True)
    return packed


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """Of every tensor's name, shape, dtype and bytes: what a cache file was written with
    (xxh3-128: it finds damage, as the KV transfer's checksums do, at memory speed)."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def _load_checked(path: Path) -> dict[str, torch.Tensor]:
    """A cache file's tensors, if they are the bytes it was written with (ValueError
    otherwise). Only some forms can be checked against the weights (_wrong_tiles):
    a damaged torch-packed form decoded wrong tokens from the second on."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        written = (f.metadata() or {}).get("xxh3_128")
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if written is None:
        raise ValueError("it carries no digest (an earlier version wrote it)")
    if written != _digest(tensors):
        raise ValueError("its bytes are not those it was written with")
    return tensors


# (part, is the head) -> the dtype that gguf_linear.c and codes_f32.c read it as.
_KERNEL_DTYPES = {
    ("tiles", False): torch.uint8,
    ("tiles", True): torch.int8,
    ("tile_scales", False): torch.float16,
    ("tile_scales", True): torch.float16,
    ("f32_codes", False): torch.uint8,
    ("f32_codes", True): torch.int8,
    ("f32_scales", False): torch.float32,
    ("f32_scales", True): torch.float32,
}


def _fitting(model: LlamaModel, tensors: dict[str, torch.Tensor], amx: bool, f32: bool) -> Packed:
    """A cache file's forms, each checked to belong to one of ``model``'s projections
    and to hold the AMX tiles if ``amx``, or only codes_f32.c's form if ``f32``
    (ValueError otherwise)."""
    packed = {}
    for name in {key.rsplit(".", 1)[0] for key in tensors}:
        linear = model.get_submodule(name)  # AttributeError for a name it does not have
        forms = Forms(*(tensors.get(f"{name}.{part}") for part in Forms._fields))
        rows, cols = linear.out_features, linear.in_features
        tiles = (rows // 16, cols // GROUP, 16)
        if f32:  # an 8-bit head's codes, or the projections' 4-bit ones
            head = name == "lm_head"
            shapes = {
                "f32_codes": (rows, cols if head else cols // 2),
                "f32_scales": (rows, cols // GROUP) if head else (rows, cols // GROUP, 2),
            }
        elif forms.packed is None:  # an 8-bit head: the AMX kernel's tiles only
            shapes = {"tiles": (*tiles, GROUP), "tile_scales": tiles}
        else:
            shapes = {
                "packed": (rows, cols // 2),
                "scales_and_zeros": (cols // GROUP, rows, 2),
                "tiles": (*tiles, 16) if amx else None,
                "tile_scales": (*tiles[:2], 32) if amx else None,
            }
        for part in Forms._fields:
            shape = shapes.get(part)
            t = getattr(forms, part)
            if (None if t is None else tuple(t.shape)) != shape:
                raise ValueError(
                    f"{name}: {part} {None if t is None else tuple(t.shape)}, "
                    f"not {shape} for {rows} x {cols}"
                )
            # The C kernels read these by their element size: a wrong dtype, past the end.
            want = _KERNEL_DTYPES.get((part, name == "lm_head"))
            if t is not None and want is not None and (t.dtype != want or not t.is_contiguous()):
                raise ValueError(f"{name}: {part} is {t.dtype}, not contiguous {want}")
        packed[name] = forms
    return packed


def _wrong_tiles(model: LlamaModel, packed: Packed) -> list[str]:
    """The projections whose AMX tiles (or codes_f32.c's codes) do not expand to
    exactly their weights in bfloat16 (float32): the kernel's own expansion, against
    the loaded weights."""
    wrong = []
    for name, forms in packed.items():
        weight = model.get_submodule(name).weight.detach()
        if forms.tiles is not None and not torch.equal(
            amx_weights(forms), weight.to(torch.bfloat16)
        ):
            wrong.append(name)
        elif forms.f32_codes is not None and not torch.equal(f32_weights(forms), weight.float()):
            wrong.append(name)
    return wrong


def _without_wrong_tiles(model: LlamaModel, packed: Packed) -> Packed:
    """``packed`` less the AMX tiles and float32 codes that ``_wrong_tiles`` finds
    (logged): those steps take the other forms, or the dense weights where there is
    none."""
    wrong = _wrong_tiles(model, packed)
    for name in wrong:
        forms = packed[name]._replace(tiles=None, tile_scales=None, f32_codes=None, f32_scales=None)
        if forms.packed is None:
            del packed[name]
        else:
            packed[name] = forms
    if wrong:
        log.warning(
            "%d projections' codes do not expand to their weights in the kernel that "
            "reads them (e.g. %s): those run without it",
            len(wrong),
            wrong[0],
        )
    return packed


def available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch, "_convert_weight_to_int4pack_for_cpu"
    )
