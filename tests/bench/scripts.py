"""Loading a bench/ script as a module, for the tests of its parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    """bench/<name>.py, registered in sys.modules (dataclasses look their module up
    there); ``unload`` takes it out again."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def unload(name: str) -> None:
    sys.modules.pop(name, None)
