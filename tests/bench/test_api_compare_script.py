"""bench/api_compare.py: one short real run on the tiny model, both APIs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "api_compare.py"


def test_both_apis_serve_the_same_requests_and_tokens():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny-random", "--requests", "4",
         "--concurrency", "2", "--input-len", "16", "--output-len", "4", "--rounds", "1",
         "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["counts"]["grpc"] == result["counts"]["openai"] == [4, 16]
    names = [row[0] for row in result["rows"]]
    assert names == ["TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E p50 ms",
                     "E2E p99 ms"]  # fmt: skip
    assert all(row[1] > 0 and row[2] > 0 for row in result["rows"])
