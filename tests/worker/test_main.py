"""The worker processes: flags and YAML onto the config, READY line, SIGTERM drains and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import grpc

from tandem._proto.tandem.v1 import worker_pb2_grpc
from tandem.config import DecodeConfig, PrefillConfig, save_yaml
from tandem.engine.sampling_params import SamplingParams
from tandem.worker.main import build_parser, load_config, main
from tests.workers import Pair, Worker, drive, engine_config, request, wait_until


def test_flags_override_the_yaml_file(tmp_path):
    path = tmp_path / "decode.yaml"
    save_yaml(path, DecodeConfig(engine=engine_config(num_blocks=7), kv_lease_s=3.0, port=5))
    args = build_parser("decode").parse_args(
        ["--config", str(path), "--port", "6", "--threads", "2", "--model", "m"]
    )
    config = load_config("decode", args)
    assert (config.port, config.kv_lease_s) == (6, 3.0)
    assert (config.engine.model, config.engine.num_blocks, config.engine.num_threads) == ("m", 7, 2)


def test_a_boolean_flag_takes_true_or_false():
    from tandem.worker.main import build_parser, load_config

    for word, value in (("false", False), ("true", True), ("no", False)):
        args = build_parser("prefill").parse_args(["--kv-layerwise", word])
        assert load_config("prefill", args).kv_layerwise is value


def test_bad_settings_exit_2_with_one_line(capsys):
    assert main("prefill", ["--kv-ack-timeout-s", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tandem: error: kv_ack_timeout_s must be > 0, got 0.0 (in flags)"
    assert main("decode", ["--kv-backend", "tcp"]) == 2
    assert "kv_backend must be ucx or inproc" in capsys.readouterr().err


def _spawn(role: str, config_path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", f"tandem.{role}_worker", "--config", str(config_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    return proc


def _ready(proc: subprocess.Popen, timeout: float = 60) -> dict[str, str]:
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not (line and line[0].startswith("READY ")):
        proc.kill()  # stderr can only be read to its end once the process is gone
        proc.wait()
        raise AssertionError(f"no READY line but {line}: {proc.stderr.read()[-2000:]}")
    words = line[0].split()
    return {"role": words[1], **dict(w.split("=", 1) for w in words[2:])}


def test_processes_serve_a_request_and_exit_0_on_sigterm(tmp_path, tiny_engine):
    engine = engine_config(num_threads=1)
    # A drain far longer than the wait below: exiting in time proves nothing was waited out.
    save_yaml(tmp_path / "p.yaml", PrefillConfig(engine=engine, drain_timeout_s=600))
    save_yaml(tmp_path / "d.yaml", DecodeConfig(engine=engine, drain_timeout_s=600))
    procs = [_spawn("prefill", tmp_path / "p.yaml"), _spawn("decode", tmp_path / "d.yaml")]
    try:
        pre, dec = (_ready(p) for p in procs)
        assert pre["role"] == "prefill" and pre["kv"] == "-"
        assert dec["role"] == "decode" and dec["kv"].startswith("127.0.0.1:")
        channels = [grpc.insecure_channel(pre["grpc"]), grpc.insecure_channel(dec["grpc"])]
        pair = Pair(
            Worker(None, channels[0], worker_pb2_grpc.PrefillWorkerStub(channels[0])),
            Worker(None, channels[1], worker_pb2_grpc.DecodeWorkerStub(channels[1])),
        )
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompt = tiny_engine.tokenizer.encode("through two processes")
        got = drive(pair, request(prompt, params))
        expected = list(tiny_engine.stream(prompt, params))
        assert got.tokens == [t for o in expected for t in o.token_ids]
        # Status is a snapshot the engine thread publishes between steps: it may lag.
        wait_until(lambda: pair.prefill.used_blocks() == 0, what="prefill blocks freed")
        wait_until(lambda: pair.decode.used_blocks() == 0, what="decode blocks freed")
        for ch in channels:
            ch.close()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(120) for p in procs]
        assert codes == [0, 0], [p.stderr.read()[-2000:] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_kv_port_in_use_exits_2_naming_it(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "tandem.decode_worker", "--model", "tiny-random",
             "--dtype", "float32", "--device", "cpu", "--num-blocks", "32", "--port", "0",
             "--kv-port", str(port)],
            capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
        )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"tandem: error: cannot listen for KV on 127.0.0.1:{port} (host/kv_port)"
    )
    assert "Traceback" not in run.stderr
