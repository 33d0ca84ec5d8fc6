"""Attention and KV-store ops behind one interface, with a backend per device kind.

``get_backend(name)`` returns a module-like object exposing ``store_kv``,
``prefill_attention`` and ``decode_attention`` with the signatures of
:mod:`tandem.kernels.torch_ref`, the reference every other backend is tested against.

Backends: ``torch`` (the reference, any device) and ``triton`` (paged kernels that
read KV blocks in place; CUDA, or CPU under ``TRITON_INTERPRET=1`` for tests).
``resolve_backend`` turns the ``attention_backend`` setting into one of them.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING

from tandem.errors import ConfigError

if TYPE_CHECKING:
    import torch

BACKENDS = ("torch", "triton")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device: torch.device) -> str:
    """The ``attention_backend`` setting for ``device``: ``auto`` is triton on CUDA when
    triton is installed, torch otherwise; the others stay as asked.

    Fails with the setting named when the asked backend cannot run on ``device``. This
    runs where the engine runs: a config written on a machine without triton (a Ray
    driver, a laptop) is still valid for workers that have it.
    """
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_installed() else "torch"
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


def get_backend(name: str) -> ModuleType:
    if name == "torch":
        from tandem.kernels import torch_ref

        return torch_ref
    if name == "triton":
        try:
            from tandem.kernels import triton as triton_backend
        except ImportError as exc:
            raise ConfigError(f"attention_backend 'triton' cannot be imported: {exc}") from exc
        return triton_backend
    raise ConfigError(
        f"attention_backend {name!r} is not available (available: {', '.join(BACKENDS)})"
    )
