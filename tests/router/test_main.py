"""``python -m tandem.router`` as a process: READY line, serving, SIGTERM exits 0."""

from __future__ import annotations

import select
import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.config import RouterConfig, save_yaml
from tandem.metrics.scrape import scrape, total
from tandem.router.__main__ import parse_config


def test_flags_override_the_yaml(tmp_path):
    path = tmp_path / "router.yaml"
    save_yaml(path, RouterConfig(model="tiny-random", port=1234, max_queue=9))
    config = parse_config(
        ["--config", str(path), "--port", "0", "--decode", "h:1", "--decode", "h:2"]
    )
    assert (config.model, config.port, config.max_queue) == ("tiny-random", 0, 9)
    assert config.decode_workers == ("h:1", "h:2") and config.prefill_workers == ()


def test_process_prints_ready_serves_health_and_metrics_and_exits_0_on_sigterm():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.router",
            "--model",
            "tiny-random",
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # never hang the suite
        assert ready, "no READY line within 60 s"
        line = proc.stdout.readline()
        assert line.startswith("READY router grpc=127.0.0.1:"), line + proc.stderr.read()
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        address = fields["grpc"]
        assert fields["metrics"].startswith("127.0.0.1:")
        samples = scrape(fields["metrics"])
        assert total(samples, "tandem_router_requests_in_flight", model="tiny-random") == 0
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # nothing in flight: no drain to wait for
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_setting_exits_2_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "tandem.router", "--model", "tiny-random", "--placement", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    expected = "placement must be one of least-loaded, round-robin, prefix-aware, got 'x'"
    assert expected in result.stderr


def test_security_flags_set_the_public_port_fields(tmp_path):
    path = tmp_path / "router.yaml"
    save_yaml(path, RouterConfig(model="tiny-random", insecure=True, api_keys_file="y.txt"))
    config = parse_config(
        ["--config", str(path), "--tls-cert", "c.pem", "--tls-key", "k.pem",
         "--tls-client-ca", "ca.pem", "--api-keys-file", "keys.txt"]
    )  # fmt: skip
    assert (config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file) == (
        "c.pem", "k.pem", "ca.pem"
    )  # fmt: skip
    assert config.api_keys_file == "keys.txt" and config.insecure  # the YAML's, kept
    assert parse_config(["--insecure"]).insecure and not parse_config([]).insecure


def test_an_exposed_host_without_tls_exits_2_naming_what_is_missing():
    result = subprocess.run(
        [sys.executable, "-m", "tandem.router", "--model", "tiny-random", "--host", "0.0.0.0",
         "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "the router's host '0.0.0.0' is not loopback and it has no TLS (tls_cert_file" in (
        result.stderr
    )
    assert "set insecure: true (--insecure) to allow this" in result.stderr
