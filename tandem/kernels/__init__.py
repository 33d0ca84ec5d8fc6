"""Attention and KV-store ops behind one interface, with a backend per device kind.

``get_backend(name)`` returns a module-like object exposing ``store_kv``,
``prefill_attention`` and ``decode_attention`` with the signatures of
:mod:`tandem.kernels.torch_ref`, the reference every other backend is tested against.
"""

from __future__ import annotations

from types import ModuleType

from tandem.errors import ConfigError

BACKENDS = ("torch",)


def get_backend(name: str) -> ModuleType:
    if name == "torch":
        from tandem.kernels import torch_ref

        return torch_ref
    raise ConfigError(
        f"attention_backend {name!r} is not available (available: {', '.join(BACKENDS)})"
    )
