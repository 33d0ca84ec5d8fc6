"""Prometheus file-based service discovery (``file_sd_configs``): the targets file that
``tandem serve --metrics`` and a Ray deployment's controller keep, and ``tandem top``
reads. A JSON list with one group per process::

    [{"targets": ["127.0.0.1:40123"], "labels": {"process": "router", "role": "router"}}]
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def group(address: str, process: str, role: str) -> dict:
    return {"targets": [address], "labels": {"process": process, "role": role}}


def write(path: str | Path, groups: list[dict]) -> None:
    """Atomically (Prometheus may read the file at any moment, never half-written),
    through a temporary file of a fresh name: a fixed one could be a link that another
    user planted in a shared directory, and writing through it would clobber the file
    it points to. Readable by all: Prometheus may run as another user."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(json.dumps(groups, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read(path: str | Path) -> list[tuple[str, str]]:
    """(address, role) for every target in the file; ValueError for a file that is not
    a list of file_sd groups (``{"targets": [address, ...], "labels": {...}}``)."""
    groups = json.loads(Path(path).read_text())
    shape = ValueError('not a list of file_sd groups ({"targets": [...], "labels": {...}})')
    if not isinstance(groups, list):
        raise shape
    listed = []
    for g in groups:
        addresses = g.get("targets", []) if isinstance(g, dict) else None
        labels = g.get("labels", {}) if isinstance(g, dict) else None
        if not (isinstance(addresses, list) and all(isinstance(a, str) for a in addresses)
                and isinstance(labels, dict)):  # fmt: skip
            raise shape
        listed += [(address, str(labels.get("role", "?"))) for address in addresses]
    return listed
