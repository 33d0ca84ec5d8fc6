"""``tandem bench transfer`` run for real: two processes, tiny sizes, JSON on stdout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.bench.transfer import KVShape, parse_size

BLOCK = KVShape().block_bytes  # 368,640 B: 30 layers x K,V x 16 tokens x 3 heads x 64 x bf16


def _bench(*flags: str) -> subprocess.CompletedProcess:
    argv = ["bench", "transfer", "--sizes", "64KiB,1MiB", "--iters", "5", "--warmup", "2"]
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *argv, *flags],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.parametrize(
    "flags",
    [
        ("--split", "request"),
        ("--tls", "tcp,self", "--split", "layer"),
        ("--path", "backend", "--read", "mapped"),
        ("--path", "backend", "--read", "get", "--split", "layer"),
    ],
    ids=["default-tls-per-request", "tcp-per-layer", "backend-mapped", "backend-get-per-layer"],
)
def test_json_rows_are_measured_and_consistent(flags):
    run = _bench("--json", *flags)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    backend = f"ucx-{flags[3]}" if "backend" in flags else "ucx"
    assert {r["backend"] for r in rows} == {backend}
    # 64 KiB rounds up to one whole block; 1 MiB to the nearest, 3 blocks.
    assert [r["size_bytes"] for r in rows] == [BLOCK, 3 * BLOCK]
    assert [r["blocks"] for r in rows] == [1, 3]
    assert {r["messages"] for r in rows} == {30 if "layer" in flags else 1}
    for r in rows:
        assert set(r) == {
            "backend", "size_bytes", "gbps", "memcpy_gbps", "ratio", "blocks", "messages"
        }  # fmt: skip
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0
        assert r["ratio"] == r["gbps"] / r["memcpy_gbps"]


def test_by_default_the_backend_path_times_both_read_paths_in_one_run():
    run = _bench("--json", "--path", "backend")
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)
    assert [(r["backend"], r["blocks"]) for r in rows] == [
        ("ucx-mapped", 1), ("ucx-mapped", 3), ("ucx-get", 1), ("ucx-get", 3)
    ]  # fmt: skip


def test_an_unknown_read_path_is_one_error_line():
    run = _bench("--path", "backend", "--read", "mapped,dma")
    assert run.returncode == 2
    assert "--read: choose from mapped and get, got 'mapped,dma'" in run.stderr


def test_bad_size_is_one_error_line():
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "transfer", "--sizes", "2XB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr == (
        "tandem: error: --sizes: cannot read '2XB'; use e.g. 64KiB, 16MiB or 1048576\n"
    )


@pytest.mark.parametrize(
    "text,expected",
    [("64KiB", 65536), ("16MiB", 16 << 20), ("1gib", 1 << 30), ("4096", 4096), ("10B", 10)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected
