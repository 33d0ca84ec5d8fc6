"""API keys: the keys file, UNAUTHENTICATED without a valid key (health exempt), and
per-key limits on streams and rate, over real channels."""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem._proto.tandem.v1 import tandem_pb2, tandem_pb2_grpc
from tandem.client import AsyncTandemClient, Overloaded, TandemClientError, Unauthenticated
from tandem.config import RouterConfig
from tandem.errors import ConfigError
from tandem.metrics.scrape import scrape, total
from tandem.router.admission import Admission, TokenBucket
from tandem.router.auth import ApiKeys, bearer_token, digest, parse_line
from tandem.router.errors import RouterError
from tandem.router.placement import Pool
from tests.router.fakes import FakeDecode, cluster, wait_until

ALICE = "alice-" + "a" * 26
BOB = "bob-" + "b" * 28
CAROL = "c" * 40
KEYS_FILE = f"""\
# the team's keys
{ALICE}  name=alice max_streams=1   # one stream at a time
{BOB} name=bob

{CAROL} requests_per_s=1
"""


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def keys_file(tmp_path) -> str:
    path = tmp_path / "keys"
    path.write_text(KEYS_FILE)
    return str(path)


# ---- the keys file ----------------------------------------------------------------------


def test_the_keys_file_gives_names_and_per_key_limits(keys_file):
    keys = ApiKeys.load(RouterConfig(api_keys_file=keys_file), environ={})
    by_name = {k.name: k for k in keys.keys}
    carol = f"key-{digest(CAROL).hex()[:8]}"  # no name: a short hash, never the key
    assert sorted(by_name) == sorted(["alice", "bob", carol])
    assert (by_name["alice"].max_streams, by_name["alice"].requests_per_s) == (1, None)
    assert (by_name[carol].max_streams, by_name[carol].requests_per_s) == (None, 1.0)
    assert ALICE not in repr(keys.keys) and by_name["alice"].digest == digest(ALICE)


def test_a_keys_file_others_can_read_is_warned_about(keys_file, caplog):
    os.chmod(keys_file, 0o644)
    ApiKeys.load(RouterConfig(api_keys_file=keys_file), environ={})
    assert "can be read by other users: chmod 600 it" in caplog.text
    caplog.clear()
    os.chmod(keys_file, 0o600)
    ApiKeys.load(RouterConfig(api_keys_file=keys_file), environ={})
    assert "chmod" not in caplog.text


def test_the_environment_adds_keys(keys_file):
    env = {"TANDEM_API_KEYS": f" {'d' * 20}, {'e' * 20} ,"}
    assert len(ApiKeys.load(RouterConfig(), environ=env)) == 2
    assert len(ApiKeys.load(RouterConfig(api_keys_file=keys_file), environ=env)) == 5
    assert ApiKeys.load(RouterConfig(), environ={}) is None


@pytest.mark.parametrize(
    "text, message",
    [("short\n", "line 1: an API key must be at least 16 characters"),
     (f"# x\n{ALICE} colour=red\n", "line 2: word 2 is none of name=..., max_streams=N, "
      "requests_per_s=X"),
     (f"{ALICE} max_streams=-1\n", "line 1: max_streams must be an integer >= 0, got '-1'"),
     (f"{ALICE} requests_per_s=nan\n", "line 1: requests_per_s must be a number >= 0, "
      "got 'nan'"),
     (f"{ALICE}\n\n{ALICE} name=again\n", "line 3: the same API key as"),
     (f"{ALICE} name=x\n{BOB} name=x\n", "API key name 'x' is given to more than one key"),
     ("# only comments\n", "no API key in api_keys_file")],
)  # fmt: skip
def test_a_bad_keys_file_is_named_without_echoing_a_key(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        ApiKeys.load(RouterConfig(api_keys_file=str(path)), environ={})
    assert message in str(info.value)
    assert ALICE not in str(info.value) and BOB not in str(info.value)


def test_a_missing_keys_file_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="^api_keys_file: cannot read .*nope: No such file"):
        ApiKeys.load(RouterConfig(api_keys_file=str(tmp_path / "nope")), environ={})


def test_comments_and_blank_lines_parse_to_nothing():
    assert parse_line("   # a comment", "here") is None
    assert parse_line("", "here") is None


@pytest.mark.parametrize(
    "metadata, token",
    [((("authorization", f"Bearer {ALICE}"),), ALICE),
     ((("authorization", f"bearer   {ALICE} "),), ALICE),
     ((("authorization", f"Basic {ALICE}"),), None),
     ((("authorization", "Bearer "),), None),
     ((("x-api-key", ALICE),), None),
     ((), None)],
)  # fmt: skip
def test_the_bearer_token_is_read_from_the_authorization_metadata(metadata, token):
    assert bearer_token(metadata) == token


def test_identify_finds_the_key_by_digest_only(keys_file):
    keys = ApiKeys.load(RouterConfig(api_keys_file=keys_file), environ={})
    assert keys.identify((("authorization", f"Bearer {BOB}"),)).name == "bob"
    assert keys.identify((("authorization", f"Bearer {BOB[:-1]}"),)) is None
    assert keys.identify(()) is None


# ---- per-key limits, as units -------------------------------------------------------------


def test_the_token_bucket_allows_a_burst_of_the_rate_then_refills():
    now = [0.0]
    bucket = TokenBucket(2.0, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.5]  # taken, taken, wait 0.5 s
    now[0] += 0.5  # one token back
    assert [bucket.take() for _ in range(2)] == [0.0, 0.5]
    slow = TokenBucket(0.2, clock=lambda: now[0])  # burst max(1, rate) = 1
    assert slow.take() == 0.0
    now[0] += 1.0
    assert slow.take() == pytest.approx(4.0)  # what a 429's Retry-After says
    now[0] += 4.0
    assert slow.take() == 0.0


def test_admission_bounds_each_key_and_the_router(keys_file):
    keys = {k.name: k for k in ApiKeys.load(RouterConfig(api_keys_file=keys_file), {}).keys}
    admission = Admission(3, key_max_streams=2)
    with admission.admit(keys["alice"]):
        with pytest.raises(RouterError, match=r"'alice' has 1 requests in flight, its limit "
                           r"\(max_streams=1\)"):  # fmt: skip
            with admission.admit(keys["alice"]):
                pass
        with admission.admit(keys["bob"]), admission.admit(keys["bob"]):
            with pytest.raises(RouterError, match=r"\(max_streams=2\)"):
                with admission.admit(keys["bob"]):
                    pass
            with pytest.raises(RouterError, match=r"\(max_queue=3\)"):
                with admission.admit(None):
                    pass
    assert admission.in_flight == 0 and admission.key_in_flight(keys["alice"]) == 0


# ---- over real channels -------------------------------------------------------------------


def _stub_call(kind: str, channel, metadata):
    stub = tandem_pb2_grpc.TandemStub(channel)
    if kind == "Generate":
        return stub.Generate(tandem_pb2.GenerateRequest(prompt="hi"), metadata=metadata)
    if kind == "GetModelInfo":
        return stub.GetModelInfo(tandem_pb2.GetModelInfoRequest(), metadata=metadata)
    return stub.Tokenize(tandem_pb2.TokenizeRequest(prompt="hi"), metadata=metadata)


@pytest.mark.parametrize("kind", ["Generate", "GetModelInfo", "Tokenize"])
@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer " + "z" * 32),), (("authorization", f"Bearer {ALICE}x"),),
     (("authorization", ALICE),)],
    ids=["no-key", "wrong-key", "key-plus-one", "no-scheme"],
)  # fmt: skip
def test_a_call_without_a_valid_key_is_unauthenticated(frontend, keys_file, caplog, kind, metadata):
    async def scenario():
        async with cluster(frontend, api_keys_file=keys_file) as c:
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                call = _stub_call(kind, channel, metadata)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    if kind == "Generate":
                        async for _ in call:
                            pass
                    else:
                        await call
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert info.value.details() == "missing or invalid API key"
            assert c.worker_calls() == 0

    with caplog.at_level(logging.DEBUG):
        run(scenario())
    assert ALICE not in caplog.text and "z" * 32 not in caplog.text


def test_a_flood_of_calls_without_a_key_does_not_flood_the_log(frontend, keys_file, caplog):
    # Each refusal wrote its own line: anyone who reached the port could grow the log
    # at hundreds of KB a second.
    async def scenario():
        async with cluster(frontend, api_keys_file=keys_file) as c:
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                stub = tandem_pb2_grpc.TandemStub(channel)
                for _ in range(200):
                    with pytest.raises(grpc.aio.AioRpcError):
                        await stub.GetModelInfo(tandem_pb2.GetModelInfoRequest())

    with caplog.at_level(logging.INFO, logger="tandem.router.auth"):
        run(scenario())
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 2, refused  # the first, and the count held at stop
    assert refused[-1].startswith("199 lines like this one were not logged: refused ")


def test_the_client_raises_unauthenticated(frontend, keys_file):
    async def scenario():
        async with cluster(frontend, api_keys_file=keys_file) as c:
            with pytest.raises(Unauthenticated, match="^UNAUTHENTICATED: missing or invalid"):
                await c.client.complete("hello")
            async with AsyncTandemClient(c.router.address, api_key="w" * 20) as client:
                with pytest.raises(Unauthenticated):
                    await client.model_info()

    run(scenario())


def test_health_needs_no_key_and_reflection_does(frontend, keys_file):
    async def scenario():
        async with cluster(frontend, api_keys_file=keys_file) as c:
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", "tandem.v1.Tandem"):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.ServerReflectionInfo(iter([request])):
                        pass
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED

    run(scenario())


def test_the_right_key_streams_and_from_the_environment_too(frontend, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEYS", f"{BOB},{CAROL}")

    async def scenario():
        async with cluster(frontend, connect={"api_key": BOB}) as c:
            done = await c.client.complete("hello")
            assert done.finish_reason == "length" and done.text == "<10><11><12><13><14>"
            assert await c.client.tokenize("hi") == frontend.tokenizer.encode("hi")
        monkeypatch.setenv("TANDEM_API_KEY", CAROL)  # the client's own variable
        async with cluster(frontend) as c:
            assert (await c.client.model_info()).model_id == "tiny-random"

    run(scenario())


def test_a_key_over_its_streams_is_refused_while_another_key_is_served(frontend, keys_file):
    async def scenario():
        decode = FakeDecode(gate=asyncio.Event())
        async with cluster(frontend, decode=[decode], connect={"api_key": ALICE},
                           api_keys_file=keys_file) as c:  # fmt: skip
            first = asyncio.create_task(c.client.complete("hello"))
            await wait_until(lambda: decode.calls, what="alice's stream placed")
            with pytest.raises(Overloaded, match=r"API key 'alice' has 1 requests in flight, "
                               r"its limit \(max_streams=1\)") as info:  # fmt: skip
                await c.client.complete("hello")
            assert info.value.retry_after_s == 1.0  # the router's hint, machine-readable
            with pytest.raises(Overloaded, match="'alice'"):  # Tokenize is admitted too
                await c.client.tokenize("hello")
            async with AsyncTandemClient(c.router.address, timeout=10, api_key=BOB) as bob:
                second = asyncio.create_task(bob.complete("hello"))
                await wait_until(lambda: len(decode.calls) == 2, what="bob's stream placed")
                decode.gate.set()
                assert (await second).finish_reason == "length"
            assert (await first).finish_reason == "length"
            assert (await c.client.complete("hello")).finish_reason == "length"  # slot back

    run(scenario())


def test_a_key_over_its_rate_is_refused_while_another_key_is_served(frontend, keys_file):
    async def scenario():
        async with cluster(frontend, connect={"api_key": CAROL}, api_keys_file=keys_file) as c:
            await c.client.model_info()  # the burst of 1
            with pytest.raises(Overloaded, match=r"API key 'key-[0-9a-f]{8}' is over its rate "
                               r"limit \(requests_per_s=1\)") as info:  # fmt: skip
                await c.client.complete("hello")
            # When the bucket has a token again, in gRPC's standard retry pushback.
            assert 0 < info.value.retry_after_s <= 1.0
            stub = tandem_pb2_grpc.TandemStub(c.client._channel)
            bearer = (("authorization", f"Bearer {CAROL}"),)
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                await stub.GetModelInfo(tandem_pb2.GetModelInfoRequest(), metadata=bearer)
            assert raw.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            pushback = dict(raw.value.trailing_metadata())["grpc-retry-pushback-ms"]
            assert 0 < int(pushback) <= 1000
            async with AsyncTandemClient(c.router.address, timeout=10, api_key=BOB) as bob:
                for _ in range(5):
                    await bob.model_info()
            assert c.worker_calls() == 0

    run(scenario())


def test_the_default_key_rate_applies_to_keys_without_their_own(frontend, keys_file):
    async def scenario():
        async with cluster(frontend, connect={"api_key": BOB}, api_keys_file=keys_file,
                           key_requests_per_s=2, metrics_port=0) as c:  # fmt: skip
            await c.client.model_info()
            await c.client.tokenize("a")
            with pytest.raises(Overloaded, match=r"'bob' is over its rate limit "
                               r"\(requests_per_s=2\)"):  # fmt: skip
                await c.client.tokenize("a")
            with pytest.raises(Overloaded):
                await c.client.model_info()
            samples = await asyncio.to_thread(scrape, c.router.metrics_address)
        # Refusals of calls that are not generations are counted too (they were not: a
        # key held at its rate by its tokenize calls showed no rejection).
        assert total(samples, "tandem_router_admission_rejections_total", reason="key_rate") == 2
        assert total(samples, "tandem_router_requests_total") == 0  # generations only

    run(scenario())


def test_a_message_that_does_not_parse_is_invalid_argument_after_the_key_check(frontend, keys_file):
    # A string field that is not UTF-8: protobuf refuses to parse it, and gRPC would
    # answer UNKNOWN; a client that builds its bytes by hand can send it.
    undecodable = b"\x0a\x02\xff\xfe"  # field 1 (prompt / request_id), two bad bytes

    async def call(c, method: str, metadata=()) -> grpc.aio.AioRpcError:
        raw = c.client._channel.unary_unary(f"/tandem.v1.Tandem/{method}")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(undecodable, metadata=metadata, timeout=10)
        return info.value

    async def scenario():
        async with cluster(frontend, api_keys_file=keys_file) as c:
            for method in ("Tokenize", "GetModelInfo"):
                assert (await call(c, method)).code() is grpc.StatusCode.UNAUTHENTICATED
            bearer = (("authorization", f"Bearer {ALICE}"),)
            error = await call(c, "Tokenize", bearer)
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "the request does not parse" in error.details()
            raw = c.client._channel.unary_stream("/tandem.v1.Tandem/Generate")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in raw(b"\x0a\x02\xff\xfe", metadata=bearer, timeout=10):
                    pass
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert c.worker_calls() == 0

    run(scenario())


def test_request_ids_are_each_keys_own(frontend, keys_file):
    # Workers key reservations by request id: without a namespace per key, one
    # caller could learn of another key's ids in flight, or block them, by trying
    # the same id.
    async def scenario():
        decode = FakeDecode(gate=asyncio.Event())
        async with cluster(frontend, decode=[decode], connect={"api_key": ALICE},
                           api_keys_file=keys_file) as c:  # fmt: skip
            first = asyncio.create_task(c.client.complete("hello", request_id="job-1"))
            await wait_until(lambda: decode.calls, what="alice's stream placed")
            async with AsyncTandemClient(c.router.address, timeout=10, api_key=BOB) as bob:
                second = asyncio.create_task(bob.complete("hello", request_id="job-1"))
                await wait_until(lambda: len(decode.calls) == 2, what="bob's stream placed")
                with pytest.raises(TandemClientError) as info:  # bob's own id is in flight
                    await bob.complete("hello", request_id="job-1")
                assert info.value.code is grpc.StatusCode.ALREADY_EXISTS
                decode.gate.set()
                assert (await second).request_id == "job-1"
            assert (await first).request_id == "job-1"
            on_workers = [call.request.request.request_id for call in decode.calls]
            keys = {k.name: k for k in ApiKeys.load(RouterConfig(api_keys_file=keys_file)).keys}
            tenants = [keys["alice"].tenant, keys["bob"].tenant]
            tag = c.router.relay.call_tag
            assert on_workers == [f"{t}~job-1/{tag}-{call}" for call, t in enumerate(tenants)]
            # ... and their own prefix cache on the workers.
            assert [call.request.request.cache_salt for call in decode.calls] == tenants

    run(scenario())


def test_prefix_placement_counts_on_a_keys_own_cached_prefixes_only(frontend, keys_file):
    async def scenario():
        async with cluster(frontend, connect={"api_key": ALICE}, api_keys_file=keys_file,
                           placement="prefix-aware") as c:  # fmt: skip
            policy, found = c.router.relay.policy, []
            pick = policy.pick

            def spy(pool, *args):
                chosen = pick(pool, *args)
                if pool is Pool.DECODE:
                    found.append(policy.cached_tokens)
                return chosen

            policy.pick = spy
            prompt = "the same long system prompt for everyone " * 8
            await c.client.complete(prompt)
            await c.client.complete(prompt)
            async with AsyncTandemClient(c.router.address, timeout=10, api_key=BOB) as bob:
                await bob.complete(prompt)
            assert found[0] == 0 and found[1] > 0 and found[2] == 0

    run(scenario())


def test_keys_share_cached_prefixes_only_when_the_config_says_so(frontend, keys_file):
    async def scenario():
        decode = FakeDecode()
        shared = {"api_keys_file": keys_file, "prefix_cache_across_keys": True}
        async with cluster(frontend, decode=[decode], connect={"api_key": ALICE}, **shared) as c:
            await c.client.complete("hello")
            assert [call.request.request.cache_salt for call in decode.calls] == [""]

    run(scenario())
