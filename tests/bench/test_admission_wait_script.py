"""bench/admission_wait.py: a short run times both ways of admitting and leaves the
engines clean."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench import scripts


def test_a_run_times_each_way_on_the_tiny_model():
    result = subprocess.run(
        [sys.executable, str(scripts.BENCH / "admission_wait.py"), "--requests", "3", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ways = json.loads(result.stdout)
    assert set(ways) == {"woken", "poll 2 ms"}
    assert all(0 < w["median_ms"] <= w["p90_ms"] <= w["max_ms"] for w in ways.values())
