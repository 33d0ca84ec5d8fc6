"""The public port's TLS, mutual TLS, and the rule that an exposed port needs both
TLS and authentication: real channels on 127.0.0.1, ports chosen at run time."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client import AsyncTandemClient, Unavailable
from tandem.config import RouterConfig
from tandem.errors import ConfigError
from tandem.router import Router
from tandem.router.public_port import PublicPort
from tests.router.fakes import cluster

KEY = "k" * 32


def run(coro):
    return asyncio.run(coro)


def tls_settings(certs, client_ca: bool = False) -> dict:
    settings = {"tls_cert_file": certs.router_cert, "tls_key_file": certs.router_key}
    if client_ca:
        settings["tls_client_ca_file"] = certs.ca
    return settings


def test_a_client_that_trusts_the_ca_streams_over_tls(frontend, certs):
    async def scenario():
        async with cluster(frontend, connect={"ca_file": certs.ca}, **tls_settings(certs)) as c:
            done = await c.client.complete("hello")
            assert done.finish_reason == "length" and done.text == "<10><11><12><13><14>"

    run(scenario())


@pytest.mark.parametrize("connect", [{"ca_file": "other_ca"}, {"tls": False}, {"tls": True}])
def test_a_client_that_cannot_verify_the_router_fails_the_handshake(frontend, certs, connect):
    """Another CA, no TLS at all, or the system's roots (which never signed a test CA)."""

    async def scenario():
        kwargs = {k: getattr(certs, v) if k == "ca_file" else v for k, v in connect.items()}
        async with cluster(frontend, **tls_settings(certs)) as c:
            async with AsyncTandemClient(c.router.address, timeout=5, **kwargs) as client:
                with pytest.raises(Unavailable):
                    await client.complete("hello")
            assert c.worker_calls() == 0

    run(scenario())


def test_mutual_tls_refuses_a_client_without_a_certificate_from_its_ca(frontend, certs):
    async def scenario():
        async with cluster(frontend, **tls_settings(certs, client_ca=True)) as c:
            address = c.router.address
            for cert, key in ((None, None), (certs.other_client_cert, certs.other_client_key)):
                async with AsyncTandemClient(
                    address, timeout=5, ca_file=certs.ca, cert_file=cert, key_file=key
                ) as client:
                    with pytest.raises(Unavailable):
                        await client.complete("hello")
            assert c.worker_calls() == 0
            async with AsyncTandemClient(
                address, timeout=5, ca_file=certs.ca, cert_file=certs.client_cert,
                key_file=certs.client_key,
            ) as client:  # fmt: skip
                assert (await client.complete("hello")).finish_reason == "length"

    run(scenario())


@pytest.mark.parametrize(
    "settings, missing",
    [({}, "no TLS (tls_cert_file and tls_key_file; API keys would travel in clear) and no "
          "authentication (api_keys_file or TANDEM_API_KEYS, or tls_client_ca_file)"),
     ({"tls": True}, "no authentication (api_keys_file or TANDEM_API_KEYS, or "
                     "tls_client_ca_file)"),
     ({"keys": True}, "no TLS (tls_cert_file and tls_key_file; API keys would travel in clear)")],
    ids=["nothing", "tls-only", "keys-only"],
)  # fmt: skip
def test_a_non_loopback_router_refuses_to_start_without_tls_and_auth(
    frontend, certs, tmp_path, settings, missing
):
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    values = {"model": "tiny-random", "host": "0.0.0.0", "port": 0}
    if settings.get("tls"):
        values.update(tls_settings(certs))
    if settings.get("keys"):
        values["api_keys_file"] = str(keys)
    router = Router(RouterConfig(**values), frontend=frontend)
    with pytest.raises(ConfigError) as info:
        run(router.start())
    assert str(info.value) == (
        f"the router's host '0.0.0.0' is not loopback and it has {missing}: anyone who "
        "reaches the port could use it. Configure them, or set insecure: true "
        "(--insecure) to allow this"
    )
    assert router.port is None  # nothing was started


def test_the_metrics_listen_on_the_public_host_only_when_told():
    assert RouterConfig(host="0.0.0.0").metrics_bind_host == "127.0.0.1"
    assert RouterConfig(host="127.0.0.2").metrics_bind_host == "127.0.0.2"
    assert RouterConfig(host="0.0.0.0", metrics_host="10.0.0.7").metrics_bind_host == "10.0.0.7"


def test_insecure_allows_a_non_loopback_router_without_tls(frontend, caplog):
    caplog.set_level(logging.WARNING, logger="tandem.router.server")

    async def scenario():
        config = RouterConfig(model="tiny-random", host="0.0.0.0", port=0, insecure=True,
                              metrics_port=0)  # fmt: skip
        router = Router(config, frontend=frontend)
        await router.start()
        try:
            assert router.address.startswith("0.0.0.0:")
            # The metrics take no key and name every worker: not on the public host
            # unless metrics_host says so, which the log says.
            assert router.metrics_address.startswith("127.0.0.1:")
            assert "router metrics on 127.0.0.1 only, not on host 0.0.0.0" in caplog.text
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await router.stop(grace=0)

    run(scenario())


def test_tls_and_keys_or_a_client_ca_are_enough_off_loopback(certs, tmp_path, monkeypatch):
    base = RouterConfig(host="0.0.0.0", **tls_settings(certs))
    monkeypatch.setenv("TANDEM_API_KEYS", KEY)
    assert PublicPort.load(base).keys is not None
    monkeypatch.delenv("TANDEM_API_KEYS")
    mutual = dataclasses.replace(base, tls_client_ca_file=certs.ca)
    assert PublicPort.load(mutual).client_ca


def test_loopback_needs_neither():
    port = PublicPort.load(RouterConfig(host="127.0.0.1"))
    assert port.credentials is None and port.keys is None


@pytest.mark.parametrize(
    "settings, message",
    [({"tls_cert_file": "c.pem"},
      "TLS needs both tls_cert_file and tls_key_file; tls_cert_file given, tls_key_file missing"),
     ({"tls_key_file": "k.pem"},
      "TLS needs both tls_cert_file and tls_key_file; tls_key_file given, tls_cert_file missing"),
     ({"tls_client_ca_file": "ca.pem"},
      "tls_client_ca_file (mutual TLS) needs the router's own tls_cert_file and tls_key_file")],
)  # fmt: skip
def test_incomplete_tls_settings_are_named(settings, message):
    with pytest.raises(ConfigError) as info:
        RouterConfig(**settings)
    assert str(info.value) == message


def test_an_unreadable_certificate_names_its_setting(certs, tmp_path):
    missing = tmp_path / "nope.pem"
    config = RouterConfig(tls_cert_file=certs.router_cert, tls_key_file=str(missing))
    with pytest.raises(ConfigError, match=rf"^tls_key_file: cannot read {missing}: "):
        PublicPort.load(config)
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("hello")
    config = dataclasses.replace(config, tls_key_file=certs.router_key,
                                 tls_client_ca_file=str(not_pem))  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^tls_client_ca_file: {not_pem} is not a PEM file"):
        PublicPort.load(config)


def test_a_certificate_and_key_that_do_not_go_together_are_named(certs):
    # gRPC took them, and every handshake then failed with no file named.
    swapped = RouterConfig(tls_cert_file=certs.router_key, tls_key_file=certs.router_cert)
    with pytest.raises(ConfigError, match=rf"^tls_cert_file: {certs.router_key} does not "
                       "hold a certificate"):  # fmt: skip
        PublicPort.load(swapped)
    foreign = RouterConfig(tls_cert_file=certs.router_cert, tls_key_file=certs.client_key)
    with pytest.raises(ConfigError, match=rf"^tls_key_file: {certs.client_key} is not the "
                       "private key of tls_cert_file's certificate"):  # fmt: skip
        PublicPort.load(foreign)
    key_as_ca = dataclasses.replace(foreign, tls_key_file=certs.router_key,
                                    tls_client_ca_file=certs.client_key)  # fmt: skip
    with pytest.raises(ConfigError, match="^tls_client_ca_file: .* does not hold a certificate"):
        PublicPort.load(key_as_ca)


def test_callers_by_client_certificate_alone_share_one_keys_limits(frontend, certs):
    # The README says they share one set of a key's limits; they had none: one such
    # caller could hold the whole max_queue.
    from tandem.client import Overloaded
    from tests.router.fakes import FakeDecode, wait_until

    member = dict(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key)

    async def scenario():
        decode = FakeDecode(gate=asyncio.Event())
        async with cluster(frontend, decode=[decode], connect=member,
                           tls_cert_file=certs.router_cert, tls_key_file=certs.router_key,
                           tls_client_ca_file=certs.ca, key_max_streams=2) as c:  # fmt: skip
            held = [asyncio.create_task(c.client.complete("hello")) for _ in range(2)]
            await wait_until(lambda: len(decode.calls) == 2, what="two streams placed")
            async with AsyncTandemClient(c.router.address, timeout=10, **member) as other:
                with pytest.raises(Overloaded, match=r"^RESOURCE_EXHAUSTED: the shared key of "
                                   r"the callers by client certificate has 2 requests in "
                                   r"flight, its limit \(max_streams=2\)"):  # fmt: skip
                    await other.complete("hello")
            decode.gate.set()
            for task in held:
                assert (await task).finish_reason == "length"

    asyncio.run(scenario())
