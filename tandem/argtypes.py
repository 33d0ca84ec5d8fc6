"""argparse types that refuse an out-of-range value at the flag, so that the error
names the flag ("argument --tp: must be >= 1, got 0") rather than the config field it
sets, or the config file it overrides."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse's name for it in "invalid ... value"
    return parse


def port(text: str) -> int:
    """A TCP port, 0 meaning any free one."""
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value
