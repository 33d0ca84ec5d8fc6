"""Regenerate tandem/_proto from proto/ (run after editing a .proto; `make proto`).

The generated modules are checked in, so installing Tandem needs no protoc;
tests/test_proto.py fails when they are out of date. protoc names modules after
the .proto paths (``tandem.v1``), which would collide with our own ``tandem``
package, so imports between generated modules are rewritten to
``tandem._proto.tandem.v1``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "tandem" / "_proto"


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    from grpc_tools import protoc  # dev dependency

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted(p for p in out_dir.rglob("*") if p.suffix in (".py", ".pyi"))
    for path in written:
        text = path.read_text()
        text = re.sub(
            r"^from tandem\.v1 import", "from tandem._proto.tandem.v1 import", text, flags=re.M
        )
        path.write_text(text)
    for pkg in {p.parent for p in written} | {out_dir}:
        while pkg != out_dir.parent:
            (pkg / "__init__.py").touch()
            pkg = pkg.parent
    return written


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)
