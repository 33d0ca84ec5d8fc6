"""Attention and KV-store ops behind one interface, with a backend per device kind.

``get_backend(name)`` returns a module-like object exposing ``store_kv``,
``prefill_attention`` and ``decode_attention`` with the signatures of
:mod:`tandem.kernels.torch_ref`, the reference every other backend is tested against.

Backends: ``torch`` (the reference, any device), ``cpu`` (a C decode kernel that
reads KV blocks in place, compiled for this machine on first use) and ``triton``
(paged kernels that read KV blocks in place; CUDA, or CPU under
``TRITON_INTERPRET=1`` for tests). ``resolve_backend`` turns the
``attention_backend`` setting into one of them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from tandem.errors import ConfigError

if TYPE_CHECKING:
    import torch

BACKENDS = ("torch", "cpu", "triton")
# An int8 KV cache keeps a float16 scale after each head's row of values (torch_ref.py;
# here, without torch, for ``tandem plan``).
INT8_SCALE_BYTES = 2


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device: torch.device, cache_dir: str | Path | None = None) -> str:
    """The ``attention_backend`` setting for ``device``: ``auto`` is triton on CUDA when
    triton is installed, cpu on a CPU where its kernels compile, torch otherwise; the
    others stay as asked. ``cache_dir``: where the cpu backend keeps its compiled
    library (default: the model cache's).

    Fails with the setting named when the asked backend cannot run on ``device``. This
    runs where the engine runs: a config written on a machine without triton or a C
    compiler (a Ray driver, a laptop) is still valid for workers that have them.
    """
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_installed() else "torch"
        return "cpu" if device.type == "cpu" and _load_cpu(cache_dir) else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ConfigError(
                f"attention_backend 'cpu' runs on CPU devices, got device {device}; "
                "use 'auto', 'torch' or 'triton' there"
            )
        if not _load_cpu(cache_dir):
            raise ConfigError(
                "attention_backend 'cpu' needs its C kernels, which could not be compiled "
                "here (the log says why: no C compiler, or the build failed); use 'auto' "
                "or 'torch'"
            )
    if name == "triton":
        if not triton_installed():
            raise ConfigError(
                "attention_backend 'triton' needs the triton package, which is not installed "
                "(CUDA builds of torch bring it); use 'auto' or 'torch'"
            )
        # Whether the kernels are interpreted was fixed when they were imported.
        if device.type != "cuda" and not get_backend("triton").INTERPRET:
            raise ConfigError(
                f"attention_backend 'triton' runs on CUDA devices, got device {device}; "
                "use attention_backend 'torch' there (or TRITON_INTERPRET=1, slow, for tests)"
            )
    return name


def _load_cpu(cache_dir: str | Path | None) -> bool:
    from tandem.kernels import cpu

    return cpu.load(Path(cache_dir) if cache_dir else None)


def get_backend(name: str) -> ModuleType:
    if name == "torch":
        from tandem.kernels import torch_ref

        return torch_ref
    if name == "cpu":
        from tandem.kernels import cpu

        return cpu
    if name == "triton":
        try:
            from tandem.kernels import triton as triton_backend
        except ImportError as exc:
            raise ConfigError(f"attention_backend 'triton' cannot be imported: {exc}") from exc
        return triton_backend
    raise ConfigError(
        f"attention_backend {name!r} is not available (available: {', '.join(BACKENDS)})"
    )
