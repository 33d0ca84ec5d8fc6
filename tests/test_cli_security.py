"""The security flags of the ``tandem`` commands: the router side (``serve``) maps onto
RouterConfig fields, the client side (``generate --router``, ``bench load`` / ``sweep``,
``demo``) onto the clients' TLS and API key."""

from __future__ import annotations

import pytest

from tandem.bench.load.cli import load_config, sweep_config
from tandem.cli import build_parser, main, serve_config
from tandem.security import tls
from tests.client.fake_router import FakeServer

KEY = "cli-key-" + "q" * 24


@pytest.fixture
def key_file(tmp_path) -> str:
    path = tmp_path / "api-key"
    path.write_text(KEY + "\n")
    return str(path)


@pytest.fixture
def tls_fake(certs):
    cert, key = open(certs.router_cert, "rb").read(), open(certs.router_key, "rb").read()
    server = FakeServer(tls.server_credentials(cert, key))
    yield server
    server.stop()


def test_serve_flags_set_the_router_fields():
    args = build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--tls-cert", "r.pem", "--tls-key", "r-key.pem",
         "--tls-client-ca", "ca.pem", "--api-keys-file", "keys.txt", "--insecure"]
    )  # fmt: skip
    router = serve_config(args).router
    assert (router.host, router.tls_cert_file, router.tls_key_file) == (
        "0.0.0.0", "r.pem", "r-key.pem"
    )  # fmt: skip
    assert (router.tls_client_ca_file, router.api_keys_file, router.insecure) == (
        "ca.pem", "keys.txt", True
    )  # fmt: skip


def test_serve_without_security_flags_keeps_the_yaml(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("router:\n  api_keys_file: from-yaml.txt\n  insecure: true\n")
    router = serve_config(build_parser().parse_args(["serve", "--config", str(path)])).router
    assert (router.api_keys_file, router.insecure, router.tls_cert_file) == (
        "from-yaml.txt", True, ""
    )  # fmt: skip


def test_serve_on_an_exposed_host_without_tls_fails_before_starting_anything(capsys):
    assert main(["serve", "--host", "0.0.0.0", "--model", "tiny-random"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: the router's host '0.0.0.0' is not loopback"), err
    assert "set insecure: true (--insecure)" in err and "tls_cert_file" in err


@pytest.mark.parametrize(
    "command",
    [["generate", "--router", "h:1", "hi"], ["bench", "load", "--target", "h:1"],
     ["bench", "sweep", "--target", "h:1", "--concurrencies", "1"], ["demo"]],
)  # fmt: skip
def test_client_commands_take_the_client_flags(command, key_file):
    flags = ["--tls-ca", "ca.pem", "--tls-cert", "c.pem", "--tls-key", "k.pem",
             "--api-key-file", key_file]  # fmt: skip
    args = build_parser().parse_args(command + flags)
    assert (args.tls_ca, args.tls_cert, args.tls_key) == ("ca.pem", "c.pem", "k.pem")
    expected = {"tls": None, "ca_file": "ca.pem", "cert_file": "c.pem", "key_file": "k.pem",
                "api_key": KEY}  # fmt: skip
    if command[0] == "bench" and command[1] == "load":
        assert load_config(args).connect == expected
    elif command[0] == "bench":
        assert all(c.connect == expected for _, c in sweep_config(args).points())


def test_generate_streams_over_tls_with_the_key_from_its_file(tls_fake, certs, key_file, capsys):
    argv = ["generate", "--router", tls_fake.address, "--raw", "--tls-ca", certs.ca,
            "--api-key-file", key_file, "hi"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out == "Hello\n"
    assert tls_fake.servicer.metadata[0]["authorization"] == f"Bearer {KEY}"


def test_generate_reports_a_refused_key_in_one_line(tls_fake, certs, key_file, capsys):
    import grpc

    tls_fake.servicer.abort = (grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
    argv = ["generate", "--router", tls_fake.address, "--tls-ca", certs.ca,
            "--api-key-file", key_file, "hi"]  # fmt: skip
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "tandem: error: UNAUTHENTICATED: missing or invalid API key\n"
    )
