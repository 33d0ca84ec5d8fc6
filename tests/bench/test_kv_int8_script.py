"""bench/kv_int8.py: how agreement is counted, and one run on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench import scripts

SCRIPT = scripts.BENCH / "kv_int8.py"


@pytest.fixture(scope="module")
def kv_int8():
    yield scripts.load("kv_int8")
    scripts.unload("kv_int8")


def test_agreement_counts_whole_requests_and_matching_prefixes(kv_int8):
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert kv_int8.agreement(ref, ref) == (1.0, 4)
    assert kv_int8.agreement(ref, [[1, 2, 9, 4], [5, 6, 7, 8]]) == (0.5, 3)
    assert kv_int8.agreement(ref, [[0, 2, 3, 4], [5, 0, 7, 8]]) == (0.0, 0.5)


def test_a_run_reports_int8_against_the_float_floor_of_the_same_run():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny-random", "--prompts", "3", "--tokens",
         "6", "--ppl-tokens", "64", "--skip-capacity", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    q = json.loads(result.stdout)["quality"]
    assert q["requests"] == 3 and q["tokens"] == 6
    assert 0 <= q["identical"] <= 1
    if q["backends"][1] is not None:  # None: the C kernels do not build on this machine
        assert sorted(q["backends"]) == ["cpu", "torch"]  # the float cache through both
        assert 0 <= q["float_identical"] <= 1
    assert q["cache"] == {"auto": q["cache"]["auto"], "int8": "int8", "int8-unbalanced": "int8"}
    assert 0 <= q["unbalanced_identical"] <= 1 and q["unbalanced_ppl_ratio"] > 0
