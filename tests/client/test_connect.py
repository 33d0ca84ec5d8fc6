"""How the clients connect: TLS, client certificates, the API key on every call, and
the command-line flags that set them."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest

from tandem.client import AsyncTandemClient, TandemClient, Unauthenticated, Unavailable
from tandem.client._connect import Connection, _hosts, read_api_key_file
from tandem.client.flags import add_client_flags, client_kwargs
from tandem.errors import ConfigError
from tandem.security import tls
from tests.client.fake_router import FakeServer

KEY = "s3cret-" + "k" * 25


@pytest.fixture
def tls_fake(certs):
    cert, key = open(certs.router_cert, "rb").read(), open(certs.router_key, "rb").read()
    server = FakeServer(tls.server_credentials(cert, key))
    yield server
    server.stop()


def test_the_key_goes_with_every_call_of_both_clients(fake):
    with TandemClient(fake.address, api_key=KEY) as client:
        list(client.generate("hi"))
        client.model_info()
        client.tokenize("hi")

    async def scenario():
        async with AsyncTandemClient(fake.address, api_key=KEY) as client:
            await client.complete("hi")
            await client.model_info()
            await client.tokenize("hi")

    asyncio.run(scenario())
    assert [m.get("authorization") for m in fake.servicer.metadata] == [f"Bearer {KEY}"] * 6


def test_the_key_comes_from_the_environment_unless_given(fake, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", KEY)
    with TandemClient(fake.address) as client:
        client.model_info()
    with TandemClient(fake.address, api_key="") as client:  # "" sends none
        client.model_info()
    assert [m.get("authorization") for m in fake.servicer.metadata] == [f"Bearer {KEY}", None]


def test_unauthenticated_raises_its_own_exception(fake):
    fake.servicer.abort = (grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
    with TandemClient(fake.address) as client:
        with pytest.raises(Unauthenticated, match="^UNAUTHENTICATED: missing or invalid API key"):
            list(client.generate("hi"))


def test_the_sync_client_speaks_tls_with_the_ca(tls_fake, certs):
    with TandemClient(tls_fake.address, ca_file=certs.ca, api_key=KEY) as client:
        assert client.complete("hi").text == "Hello"
    with TandemClient(tls_fake.address, ca_file=certs.other_ca, timeout=5) as client:
        with pytest.raises(Unavailable):
            client.model_info()
    assert [m.get("authorization") for m in tls_fake.servicer.metadata] == [f"Bearer {KEY}"]


def test_a_key_is_never_sent_in_clear_off_this_machine(certs):
    with pytest.raises(ConfigError, match=r"refusing to send an API key in clear to "
                       r"10\.0\.0\.1:50051: connect with TLS"):  # fmt: skip
        Connection.make("10.0.0.1:50051", api_key=KEY)
    assert Connection.make("localhost:1", api_key=KEY).metadata
    assert Connection.make("[::1]:1", api_key=KEY).metadata
    assert Connection.make("ipv4:127.0.0.1:1,127.0.0.2:1", api_key=KEY).metadata
    with pytest.raises(ConfigError, match="in clear to ipv4:127.0.0.1:1,10.0.0.1:1"):
        Connection.make("ipv4:127.0.0.1:1,10.0.0.1:1", api_key=KEY)
    assert Connection.make("10.0.0.1:1", api_key=KEY, tls_on=True).credentials is not None
    assert Connection.make("10.0.0.1:1", api_key=KEY, ca_file=certs.ca).metadata
    assert KEY not in repr(Connection.make("localhost:1", api_key=KEY))


@pytest.mark.parametrize(
    "address, port",
    [("127.0.0.1:99999", "99999"), ("[::1]:65536", "65536"), ("localhost:0", "0"),
     ("127.0.0.1:http", "http"), ("ipv4:127.0.0.1:1,127.0.0.2:70000", "70000"),
     ("dns:///example.com:-1", "-1")],
)  # fmt: skip
def test_a_port_gRPC_would_dial_another_is_refused(address, port):
    """gRPC read port 99999 as 99999 mod 65536: the client reached a router on 34463."""
    target = address.rpartition(",")[2].removeprefix("ipv4:").removeprefix("dns:///")
    with pytest.raises(ConfigError) as err:
        Connection.make(address)
    assert str(err.value) == (
        f"router address {target!r}: the port must be a number in [1, 65535], got {port!r}"
    )
    for fine in ("localhost", "::1", "[::1]", "[::1]:65535", "unix:/tmp/s", "dns:///h:1"):
        assert Connection.make(fine).address == fine  # no port: gRPC's default


@pytest.mark.parametrize("keepalive_s", [0, "5", float("inf"), float("nan"), 1e12, True])
def test_a_keepalive_that_is_no_number_of_seconds_gRPC_takes_is_named(keepalive_s):
    # "5" was a raw TypeError, inf and 1e12 an OverflowError from gRPC's options.
    with pytest.raises(ConfigError, match=r"^keepalive_s must be seconds in \(0, 2,147,483\] "
                       r"or None \(no pings\), got "):  # fmt: skip
        Connection.make("127.0.0.1:1", keepalive_s=keepalive_s)
    assert Connection.make("127.0.0.1:1", keepalive_s=2_147_483).options


@pytest.mark.parametrize(
    "kwargs, message",
    [({"cert_file": "c.pem"}, "a client certificate needs both cert_file and key_file"),
     ({"tls_on": False, "ca_file": "ca.pem"}, "ca_file, cert_file and key_file are for TLS"),
     ({"ca_file": "/nonexistent/ca.pem"}, "ca_file: cannot read /nonexistent/ca.pem")],
)  # fmt: skip
def test_bad_tls_arguments_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        Connection.make("127.0.0.1:1", **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(ca_file="ca_key"), "^ca_file: {ca_key} does not hold a certificate"),
     (dict(ca_file="ca", cert_file="client_key", key_file="client_cert"),
      "^cert_file: {client_key} does not hold a certificate"),
     (dict(ca_file="ca", cert_file="client_cert", key_file="router_key"),
      "^key_file: {router_key} is not the private key of cert_file's certificate")],
)  # fmt: skip
def test_a_pem_file_of_the_wrong_kind_is_named_when_the_client_is_made(
    certs, tmp_path, kwargs, message
):
    # Each was taken, and every call then failed as Unavailable ("Failed to create
    # security handshaker"): an outage to retry, not a setting to fix.
    paths = {**vars(certs), "ca_key": str(tmp_path / "ca_key.pem")}
    (tmp_path / "ca_key.pem").write_bytes(open(certs.client_key, "rb").read())
    with pytest.raises(ConfigError, match=message.format(**paths)):
        TandemClient("127.0.0.1:1", **{k: paths[v] for k, v in kwargs.items()})


@pytest.mark.parametrize(
    "address, host",
    [("127.0.0.1:50051", "127.0.0.1"), ("[::1]:5", "::1"), ("dns:///example.com:443",
     "example.com"), ("localhost", "localhost"), ("unix:/tmp/sock", "localhost"),
     ("ipv4:127.0.0.1:5", "127.0.0.1"), ("ipv6:[::1]:5", "::1"), ("dns:127.0.0.1:5",
     "127.0.0.1"), ("dns://8.8.8.8/localhost:5", "localhost"),
     ("ipv4:127.0.0.1:5,10.0.0.1:5", "127.0.0.1,10.0.0.1")],
)  # fmt: skip
def test_the_host_of_an_address(address, host):
    # A gRPC target with a scheme (ipv4:127.0.0.1:5) was taken for a remote host, so an
    # API key over loopback was refused with a message that loopback is allowed.
    assert _hosts(address) == tuple(host.split(","))


def test_the_api_key_file_holds_one_key(tmp_path):
    path = tmp_path / "key"
    path.write_text(f"  {KEY}\n")
    assert read_api_key_file(str(path)) == KEY
    path.write_text(f"{KEY} name=alice\n")
    with pytest.raises(ConfigError, match="must hold one API key and nothing else"):
        read_api_key_file(str(path))
    with pytest.raises(ConfigError, match="^--api-key-file: cannot read"):
        read_api_key_file(str(tmp_path / "missing"))


def test_client_flags_become_client_arguments(tmp_path):
    parser = argparse.ArgumentParser()
    add_client_flags(parser)
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    args = parser.parse_args(["--tls-ca", "ca.pem", "--tls-cert", "c.pem", "--tls-key",
                              "k.pem", "--api-key-file", str(key_file)])  # fmt: skip
    assert client_kwargs(args) == {"tls": None, "ca_file": "ca.pem", "cert_file": "c.pem",
                                   "key_file": "k.pem", "api_key": KEY}  # fmt: skip
    assert client_kwargs(parser.parse_args(["--tls"])) == {
        "tls": True, "ca_file": None, "cert_file": None, "key_file": None, "api_key": None
    }  # fmt: skip


def test_a_key_gRPC_metadata_cannot_carry_is_named_not_sent():
    from tandem.client._connect import Connection

    with pytest.raises(ConfigError, match=r"^api_key: an API key is printable ASCII"):
        Connection.make("127.0.0.1:1", api_key="clé-" + "x" * 20)
    with pytest.raises(ConfigError, match=r"^\$TANDEM_API_KEY: an API key is printable ASCII"):
        Connection.make("127.0.0.1:1", environ={"TANDEM_API_KEY": "abc\x01def" * 3})
