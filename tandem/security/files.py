"""Secrets on disk: written owner-only, whatever was at the path before."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_private(path: str | Path, data: bytes) -> None:
    """``data`` at ``path``, mode 0600. Written beside it and renamed into place: an
    existing file keeps no looser mode (``open(O_CREAT, 0o600)`` would keep it), and a
    symlink there is replaced, not followed to wherever it points."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
