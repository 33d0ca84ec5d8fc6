"""Where the engine runs and in which dtype: what ``device: auto`` and ``dtype: auto`` pick.

``dtype: auto`` is bfloat16 on CUDA and on CPUs that compute in bfloat16 natively
(AVX512-BF16 or AMX-BF16: oneDNN then runs bfloat16 matmuls at about twice the
float32 rate, and the weights and KV take half the memory traffic); float32 on
every other CPU, where bfloat16 would be emulated and slower. Token parity with
Hugging Face is checked in float32, which tests ask for explicitly.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tandem.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# /proc/cpuinfo flags of the instructions that compute in bfloat16 (not just convert).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device {name!r} is not a torch device: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
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
