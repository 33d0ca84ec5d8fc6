"""Where the engine runs and in which dtype: what ``device: auto`` and ``dtype: auto`` pick.

``dtype: auto`` is bfloat16 on CUDA and on CPUs that compute in bfloat16 natively
(AVX512-BF16 or AMX-BF16: oneDNN then runs bfloat16 matmuls at about twice the
float32 rate, and the weights and KV take half the memory traffic); float32 on
every other CPU, where bfloat16 arithmetic is emulated and slower for batches (a
lone stream, bound by reading the weights, can still gain from bfloat16's half the
bytes: bench/README.md, the AVX2-only VM). Token parity with Hugging Face is
checked in float32, which tests ask for explicitly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from pathlib import Path

import torch

from tandem.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# /proc/cpuinfo flags of the instructions that compute in bfloat16 (not just convert).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# glibc mallopt parameters (malloc.h) and the values the engine sets on CPU.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for it on 64-bit
TRIM_THRESHOLD_BYTES = 256 << 20

log = logging.getLogger(__name__)


def resolve_device(name: str, gpus: int = 1) -> torch.device:
    """The torch device that ``device: name`` stands for, checked: "auto", "cpu",
    "cuda" or "cuda:N", with ``gpus`` GPUs from N on (one per tensor-parallel rank)."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        name = "cuda"  # and as many GPUs as the ranks need, checked below
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device {name!r} is not a torch device: {exc}") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is not supported: Tandem runs on cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available")
        first, count = device.index or 0, torch.cuda.device_count()
        if first + gpus > count:
            needs = f"GPUs {first}..{first + gpus - 1}" if gpus > 1 else f"GPU {first}"
            raise ConfigError(f"device {name!r} needs {needs} (one per tensor-parallel "
                              f"rank), but this host has {count}")  # fmt: skip
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        native = device.type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    return DTYPES[name]


@functools.cache
def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has a bfloat16 compute instruction set (Linux; False elsewhere)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return native_bf16_in(text)


def native_bf16_in(cpuinfo: str) -> bool:
    """Whether a /proc/cpuinfo text lists a bfloat16 compute flag on its first CPU."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return not NATIVE_BF16_FLAGS.isdisjoint(value.split())
    return False


@functools.cache
def keep_step_buffers_mapped() -> bool:
    """Have glibc serve the engine's per-step temporaries from its heap, not fresh mmaps.

    A CPU step allocates and frees tensors of a few MB per layer (gathered K/V,
    activations of a prefill chunk). Above glibc's mmap threshold each is a fresh
    mapping whose pages fault in on first touch, every step (bench/README.md says what
    was and was not measured of it). Raising the
    threshold to 32 MiB (its ceiling) and the trim threshold to 256 MiB keeps that
    memory in the process between steps. Once per process; False where the C
    library has no ``mallopt`` (not glibc).
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    done = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and done
    if not done:
        log.warning("mallopt refused the engine's thresholds; CPU steps may page-fault more")
    return done
