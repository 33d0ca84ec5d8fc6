"""The commands' argument errors, and the harness's independence from server code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.cli import main

LOAD = ["bench", "load", "--target", "127.0.0.1:1"]


@pytest.mark.parametrize(
    "argv, message",
    [(["bench", "load"], "the following arguments are required: --target"),
     ([*LOAD, "--dataset", "csv"], "argument --dataset: invalid choice: 'csv'"),
     (["bench", "sweep", "--target", "x:1", "--out", "d"],
      "one of the arguments --request-rates --concurrencies is required"),
     (["bench", "sweep", "--target", "x:1", "--request-rates", "1,two"],
      "expected comma-separated numbers, got '1,two'"),
     (["plan", "--context-len", "many"], "argument --context-len: invalid int value")],
)  # fmt: skip
def test_argparse_errors_exit_2_with_the_argument_named(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [([*LOAD, "--request-rate", "-1"], "--request-rate must be > 0, got -1.0"),
     ([*LOAD, "--num-requests", "0"], "--num-requests must be >= 1, got 0"),
     ([*LOAD, "--num-requests", "5", "--duration", "3"],
      "give one of --num-requests or --duration"),
     ([*LOAD, "--duration", "3"], "--duration needs a finite --request-rate or a "
      "--max-concurrency"),
     ([*LOAD, "--input-len", "uniform:9-3"], "--input-len lengths must be >= 1"),
     ([*LOAD, "--input-len", "normal:nan,5"], "--input-len lengths must be >= 1"),
     ([*LOAD, "--output-len", "normal:inf,1"], "--output-len lengths must be >= 1"),
     ([*LOAD, "--duration", "inf", "--request-rate", "5"],
      "--duration must be > 0 and finite, got inf"),
     ([*LOAD, "--num-requests", "1", "--timeout", "inf"],
      "--timeout must be > 0 and finite, got inf"),
     ([*LOAD, "--dataset", "jsonl"], "--dataset jsonl needs --dataset-path"),
     ([*LOAD, "--dataset-in-order"], "--dataset-in-order is for jsonl and sharegpt files"),
     ([*LOAD, "--slo-ttft-ms", "0"], "--slo-ttft-ms must be > 0, got 0.0"),
     (["bench", "sweep", "--target", "x:1", "--concurrencies", "1,2"],
      "bench sweep needs --out DIR"),
     (["plan", "--sweep", "s.json"], "--sweep and --target-rate go together"),
     (["plan", "--kv-dtype", "int3"], "--kv-dtype must be one of"),
     (["plan", "--block-size", "3"], "--block-size must be a power of two >= 1"),
     (["top", "--target", "127.0.0.1:1", "--interval", "nan"], "--interval must be a number > 0"),
     (["plan", "--model", "no-such-model"], "unknown model 'no-such-model'"),
     # Sent as given, every request failed with a bare "errors INVALID_ARGUMENT 3".
     ([*LOAD, "--temperature", "-1"], "--temperature must be finite and >= 0, got -1.0"),
     ([*LOAD, "--temperature", "nan"], "--temperature must be finite and >= 0, got nan"),
     ([*LOAD, "--temperature", "inf"], "--temperature must be finite and >= 0, got inf"),
     # gRPC dialled 99999 mod 65536 = 34463; over HTTP it was an OverflowError traceback.
     (["bench", "load", "--target", "127.0.0.1:99999"],
      "--target '127.0.0.1:99999': the port must be a number in [1, 65535], got '99999'"),
     (["bench", "load", "--target", "[::1]:x"], "--target '[::1]:x': the port must be"),
     (["bench", "load", "--api", "openai", "--target", "http://127.0.0.1:99999/v1"],
      "--target '127.0.0.1:99999': the port must be a number in [1, 65535]")],
)  # fmt: skip
def test_bad_values_end_with_one_line_and_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: ") and message in err, err


def test_a_target_without_a_router_is_a_clear_error(capsys):
    assert main([*LOAD, "--num-requests", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "UNAVAILABLE: cannot reach a router at 127.0.0.1:1" in err, err


def test_plan_prints_its_arithmetic(capsys):
    assert main(["plan", "--device-memory-gib", "24", "--context-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert "= 23,040 B (22.5 KiB)" in out
    assert "ceil(2048 / 16) = 128 blocks per sequence" in out


SERVER_SIDE = ("torch", "tandem.engine", "tandem.router", "tandem.prefill_worker",
               "tandem.decode_worker", "tandem.worker", "tandem.kv_transfer")  # fmt: skip


def test_the_harness_imports_no_server_code():
    code = (
        "import sys\n"
        "import tandem.bench.load.cli, tandem.bench.load.runner, tandem.bench.load.report\n"
        "import tandem.bench.load.sweep, tandem.bench.load.server_metrics\n"
        f"print([m for m in sys.modules if m.startswith({SERVER_SIDE!r})])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "points, expect",
    [(["--request-rates", "2,0.5"], ("request_rate", 0.5)),
     (["--concurrencies", "4,2"], ("max_concurrency", 2))],
)  # fmt: skip
def test_a_duration_sweep_builds_every_point(points, expect):
    # The base config once failed its own "--duration needs a finite rate" check.
    from tandem.bench.load.cli import sweep_config
    from tandem.cli import build_parser

    argv = ["bench", "sweep", "--target", "127.0.0.1:1", "--duration", "5", "--out", "x"]
    config = sweep_config(build_parser().parse_args(argv + points))
    assert getattr(config.base, expect[0]) == expect[1]
    assert [c.duration_s for _, c in config.points()] == [5, 5]
    # Each point its own prompts: repeating them would hit the server's prefix cache.
    assert [c.seed for _, c in config.points()] == [0, 1]


def test_a_run_in_which_no_request_completed_exits_1(capsys, caplog, tmp_path):
    import grpc

    from tests.client.fake_router import FakeServer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n' * 3)
    fake = FakeServer()
    try:
        fake.servicer.abort_generate = (grpc.StatusCode.UNAVAILABLE, "decode worker died")
        argv = ["bench", "load", "--target", fake.address, "--num-requests", "3", "--num-warmup",
                "0", "--dataset", "jsonl", "--dataset-path", str(prompts), "--quiet"]  # fmt: skip
        assert main(argv) == 1
        out = capsys.readouterr().out
        assert "0 completed, 3 failed" in out, out  # the table is printed all the same
        # A sweep none of whose points completed a request: no more a measurement.
        sweep = ["bench", "sweep", *argv[2:], "--request-rates", "5,10", "--out",
                 str(tmp_path / "sweep")]  # fmt: skip
        assert main(sweep) == 1
        assert "no point completed any of its requests" in caplog.text
        fake.servicer.abort_generate = None
        assert main(argv) == 0
    finally:
        fake.stop()
