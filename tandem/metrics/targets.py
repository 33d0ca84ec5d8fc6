"""Prometheus file-based service discovery (``file_sd_configs``): the targets file that
``tandem serve --metrics`` and a Ray deployment's controller keep, and ``tandem top``
reads. A JSON list with one group per process::

    [{"targets": ["127.0.0.1:40123"], "labels": {"process": "router", "role": "router"}}]
"""

from __future__ import annotations

import json
from pathlib import Path


def group(address: str, process: str, role: str) -> dict:
    return {"targets": [address], "labels": {"process": process, "role": role}}


def write(path: str | Path, groups: list[dict]) -> None:
    """Atomically: Prometheus may read the file at any moment, never half-written."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    tmp.replace(path)


def read(path: str | Path) -> list[tuple[str, str]]:
    """(address, role) for every target in the file."""
    groups = json.loads(Path(path).read_text())
    return [
        (address, g.get("labels", {}).get("role", "?"))
        for g in groups
        for address in g.get("targets", [])
    ]
