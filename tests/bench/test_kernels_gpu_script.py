"""bench/kernels_gpu.py without a GPU: its CPU pass, and its timed cases on tiny shapes.

The script is meant to be run blind on a GPU machine in one call; these tests run
every code path it has there (cases, checks, report) on CPU, the kernels
interpreted, so that run does not die on a typo.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.bench import scripts
from tests.kernels.conftest import triton_backend_or_skip

SCRIPT = scripts.BENCH / "kernels_gpu.py"


@pytest.fixture(scope="module")
def script():
    yield scripts.load("kernels_gpu")
    scripts.unload("kernels_gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; a GPU would time for real")
def test_without_cuda_it_checks_on_tiny_shapes_and_says_so():
    triton_backend_or_skip()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("no CUDA device: nothing to time")
    summary = json.loads(lines[-1])
    assert summary["device"] == "cpu" and summary["failed"] == []
    # decode, prefill, store_kv x 2 layouts x (3 dtypes + an int8 cache), and the checksum
    assert summary["checked"] == 25
    checksum = next(r for r in summary["rows"] if r["section"] == "checksum")
    assert checksum["ok"] is True and checksum["bytes"] == 1 << 16


def test_help_names_the_options():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0
    for flag in ("--quick", "--no-sweep", "--budget-s"):
        assert flag in run.stdout


def test_timed_cases_run_and_report(script, monkeypatch, capsys):
    ops = triton_backend_or_skip()
    from tandem.kernels import torch_ref

    monkeypatch.setattr(script, "HEADS_7B", (4, 2, 16))
    monkeypatch.setattr(script, "BLOCK_SIZE", 4)
    b = script.Bench(torch.device("cpu"), budget_s=60)
    b.run("decode", "2 x 37", lambda: script.decode_case(b, ops, 2, 37, copy_gbps=10.0))
    b.run("prefill", "9 new", lambda: script.prefill_case(b, ops, 9, 0, mm_tflops=1.0))
    b.run("prefill", "5 + 11", lambda: script.prefill_case(b, ops, 5, 11, mm_tflops=1.0))
    b.run("store", "7 tokens", lambda: script.store_case(b, ops, torch_ref, 7, copy_gbps=10.0))
    b.run("int8 kv", "int8", lambda: script.int8_decode_case(b, ops, torch_ref, 2, 37, 10.0))
    b.run("profile", "norms", lambda: script.norm_rope_case(b, 3))
    monkeypatch.setattr(script, "KV_SHAPE", {"layers": 4, "kv_heads": 2, "head_dim": 16})
    # The device-to-device check, host to host here (UCX gets, as between GPUs).
    b.run("kvxfer", "ucx", lambda: script.kv_transfer_case(b, 1, 10.0))
    # Tensor parallelism as on GPUs with NCCL, with gloo on the CPU here.
    b.run("tp", "2 ranks", lambda: script.tensor_parallel_case(b, 2))
    tier = b.run("tier", "host tier", lambda: script.host_tier_case(b, 3))
    tiles = {"block_n": 16, "num_warps": 1, "num_stages": 1}
    b.run("sweep", "tiles", lambda: script.decode_case(b, ops, 1, 20, 10.0, **tiles))
    b.run("broken", "raises", lambda: 1 / 0)
    b.budget_s = -1
    b.run("late", "skipped", lambda: pytest.fail("ran past the budget"))

    status = script.report(b, {"device": "cpu"})

    assert status == 1  # the case that raised
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["failed"] == ["broken: raises"]
    assert summary["skipped"] == 1
    rows = {r["case"]: r for r in summary["rows"]}
    for case in ("2 x 37", "9 new", "5 + 11", "7 tokens", "int8", "tiles"):
        assert rows[case]["ok"] is True, case
        assert rows[case]["ms"] > 0 and rows[case]["sdpa_ms"] > 0
    assert rows["ucx"]["ok"] is True and rows["ucx"]["gbps"] > 0, rows["ucx"]
    assert rows["ucx"]["bytes"] == 1 << 20  # 512 blocks of 2 KiB
    assert rows["2 ranks"]["ok"] is True and rows["2 ranks"]["one_gpu_ms"] > 0
    assert "sdpa_gbps" in rows["2 x 37"] and "sdpa_tflops" in rows["9 new"]
    assert rows["int8"]["bf16_over_int8"] > 0
    assert rows["norms"]["ok"] is None and rows["norms"]["rmsnorm_ms"] > 0
    assert tier.ok is True and rows["host tier"]["out_gbps"] > 0, tier.note


def test_a_case_that_needs_a_missing_module_is_skipped_not_failed(script, capsys):
    # A bare GPU image has torch and triton: the checksum and profile rows failed on
    # ModuleNotFoundError, and the run exited 1 for it.
    b = script.Bench(torch.device("cpu"), budget_s=60)

    def needs_xxhash():
        raise ModuleNotFoundError("No module named 'xxhash'", name="xxhash")

    row = b.run("checksum", "64 MiB", needs_xxhash)
    assert row.ok is None and row.note == "skipped: needs xxhash, not installed"
    assert script.report(b, {"device": "cpu"}) == 0


def test_after_a_sticky_cuda_error_the_rest_is_skipped_and_reported(script, monkeypatch, capsys):
    # A sticky error fails every later CUDA call, empty_cache too: it raised out of the
    # error handler, and the run died with no table and no JSON.
    b = script.Bench(torch.device("cpu"), budget_s=60)
    b.cuda = True

    def lost(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", lost)
    monkeypatch.setattr(torch.cuda, "empty_cache", lost)
    b.run("decode", "raises", lambda: lost())
    b.free()
    later = b.run("decode", "later", lambda: pytest.fail("ran on a lost context"))
    assert later.ok is None and later.note.startswith("skipped: the CUDA context is lost")
    assert "illegal memory access" in later.note
    assert script.report(b, {"device": "cpu", "copy_gbps": float("nan")}) == 1
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])  # strict JSON: no NaN
    assert summary["copy_gbps"] is None and summary["failed"] == ["decode: raises"]


def test_an_import_that_breaks_inside_tandem_or_triton_still_fails(script, capsys):
    # Only a missing optional module skips a case: a renamed tandem module or a changed
    # triton API passed the run as "not installed".
    b = script.Bench(torch.device("cpu"), budget_s=60)
    for name in ("tandem.kv_transfer.device_checksum", "triton.language.extra"):

        def broken(name=name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        assert b.run("checksum", name, broken).ok is False

    def renamed():
        raise ImportError("cannot import name 'checksum_triton'")

    assert b.run("checksum", "renamed", renamed).ok is False
    assert script.report(b, {"device": "cpu"}) == 1
