"""Every Triton kernel compiles for real GPUs and fits their shared memory.

The rest of the suite interprets the kernels (TRITON_INTERPRET=1), which applies
neither Triton's language rules nor a device's limits: the device checksum read
plain globals, which the compiler refuses, so every KV transfer between GPU workers
would have failed at its first checksum; and the prefill's large tiles took 96 KiB
of shared memory, more than a Turing GPU has. gpu_compile.py compiles them in a
process without the interpreter (Triton's front end and bundled ptxas; no GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("gpu_compile.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "only"),
    [(90, ""), (86, "head_dim 256"), (75, "prefill")],
    ids=["hopper", "ampere-86-widest-heads", "turing-prefill"],
)
def test_every_kernel_compiles_for_a_gpu_and_fits_its_shared_memory(arch, only, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a compile cached with other settings hides one
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, str(SCRIPT), str(arch), "--only", only], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) >= (2 if only else 10)
    failed = [r for r in results if "error" in r or r["shared"] > r["limit"]]
    assert not failed, json.dumps(failed, indent=1)
