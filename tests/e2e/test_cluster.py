"""A real cluster (router + workers as processes on loopback ports) driven as clients do.

Uses tiny-random except for the parity test on the default model. Every test
leaves each worker with zero used KV blocks.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.client import TandemClient
from tandem.client.errors import DeadlineExceeded, InvalidRequest
from tandem.config import DecodeConfig, DisaggregationConfig, EngineConfig, RouterConfig
from tandem.deploy.local import ClusterConfig, LocalCluster
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import ConfigError
from tandem.metrics import METRICS
from tandem.metrics.scrape import declared, fetch, scrape, total

PROMPTS = ["Hello there, how are you?", "你好，请介绍一下你自己。", "long prompt " * 60]


def _cluster(
    tmp_path_factory, name, model="tiny-random", prefill=1, decode=1, router=None,
    metrics=False, widths=(None, None), decode_config=None, **engine,
):  # fmt: skip
    """``widths``: the prefill and decode pools' tensor-parallel widths, if not the
    engine's; ``decode_config``: the decode workers' own settings."""
    engine.setdefault("dtype", "float32")  # as the colocated engines compared with it
    engine_cfg = EngineConfig(model=model, num_blocks=engine.pop("num_blocks", 256), **engine)
    config = ClusterConfig(
        num_prefill=prefill, num_decode=decode, engine=engine_cfg, threads_per_worker=1,
        router=RouterConfig(port=0, **(router or {})), metrics=metrics,
        decode=DecodeConfig(**(decode_config or {})),
        prefill_tensor_parallel_size=widths[0], decode_tensor_parallel_size=widths[1],
    )  # fmt: skip
    return LocalCluster(config, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with _cluster(tmp_path_factory, "c22", prefill=2, decode=2, metrics=True) as c:
        yield c


def _status(c: LocalCluster, worker) -> worker_pb2.WorkerStatus:
    stub = (
        worker_pb2_grpc.PrefillWorkerStub
        if worker.name.startswith("prefill")
        else worker_pb2_grpc.DecodeWorkerStub
    )
    with c.dial(worker.ready["grpc"]) as ch:  # as a member: workers speak mutual TLS
        return stub(ch).Status(worker_pb2.StatusRequest(), timeout=5)


def _workers(c: LocalCluster) -> list:
    return [p for p in c.processes if p.name != "router"]


def _assert_no_blocks_used(c: LocalCluster, within_s: float = 30.0) -> None:
    """Every worker's blocks are back within ``within_s`` (a ceiling against a hang; 0: now)."""
    deadline = time.monotonic() + within_s
    while True:
        used = {w.name: _status(c, w).kv_blocks_used for w in _workers(c)}
        if not any(used.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still used: {used}")
        time.sleep(0.05)


def _colocated(tiny_engine, text: str, params: SamplingParams, raw: bool = False):
    tok = tiny_engine.tokenizer
    ids = tok.encode(text) if raw else tok.encode_chat([{"role": "user", "content": text}])
    outs = list(tiny_engine.stream(ids, params))
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


def _remote(address: str, text: str, **kw):
    with TandemClient(address, timeout=60) as client:
        chunks = list(client.generate(messages=[{"role": "user", "content": text}], **kw))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]


def test_greedy_through_the_cluster_equals_colocated(cluster, tiny_engine):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for text in PROMPTS:
        tokens, out, last = _remote(cluster.address, text, max_tokens=24, temperature=0,
                                    ignore_eos=True)  # fmt: skip
        assert (tokens, out) == _colocated(tiny_engine, text, params)
        assert last.finish_reason == "length" and last.usage.completion_tokens == 24
    _assert_no_blocks_used(cluster)


def test_seeded_sampling_through_the_cluster_equals_colocated(cluster, tiny_engine):
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    tokens, out, _ = _remote(cluster.address, PROMPTS[0], **kw)
    assert (tokens, out) == _colocated(tiny_engine, PROMPTS[0], SamplingParams(**kw))


def test_concurrent_streams_complete_and_every_worker_gets_work(cluster, tiny_engine):
    # Start from idle workers as the router sees them: least-loaded placement sends a
    # burst to the decode workers with the most free KV, so blocks still held by an
    # earlier test at the router's last poll could keep one of them out of it.
    _assert_no_blocks_used(cluster)
    time.sleep(2 * cluster.config.router.status_interval_s)
    before = {w.name: _status(cluster, w).served for w in _workers(cluster)}
    texts = [f"request number {i}: " + "words " * (i % 5) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(
            lambda t: _remote(cluster.address, t, max_tokens=12, temperature=0, ignore_eos=True),
            texts,
        ))  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for text, (tokens, out, _) in zip(texts, results, strict=True):
        assert (tokens, out) == _colocated(tiny_engine, text, params)
    # Work reached all four workers: each one's served counter moved.
    served = {w.name: _status(cluster, w).served - before[w.name] for w in _workers(cluster)}
    assert all(v > 0 for v in served.values()), served
    _assert_no_blocks_used(cluster)


def _address(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    address = ipaddress.ip_address(ip)
    return getattr(address, "ipv4_mapped", None) or address  # ::ffff:127.0.0.1 is loopback


def test_workers_listen_on_loopback_only(cluster):
    """A local cluster is reachable from this machine only. UCX's TCP transport listens
    on every interface unless told which; the decode worker's KV listener is the one
    wildcard, and a socket filter keeps it to its host (kv_transfer/ucx/sockets.py)."""
    _remote(cluster.address, PROMPTS[0], max_tokens=2)  # KV has moved: UCX is up
    for worker in _workers(cluster):
        kv_port = int(worker.ready["kv"].rsplit(":", 1)[1]) if worker.ready["kv"] != "-" else None
        process = psutil.Process(worker.popen.pid)
        listening = {
            (c.laddr.ip, c.laddr.port)
            for p in (process, *process.children(recursive=True))
            for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        }
        assert listening, worker.name
        off_loopback = {
            (ip, port) for ip, port in listening
            if not _address(ip).is_loopback
            and not (_address(ip).is_unspecified and port == kv_port)
        }  # fmt: skip
        assert not off_loopback, (worker.name, off_loopback)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(temperature=-1.0), "temperature must be finite and >= 0, got -1.0"),
        (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(min_p=2.0), "min_p must be in [0, 1], got 2.0"),
        (dict(stop=[""]), "stop strings must be non-empty"),
        (dict(max_tokens=5000), "exceeds the context length 4096"),
    ],
)
def test_bad_input_is_invalid_argument_and_allocates_nothing(cluster, kw, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        _remote(cluster.address, "hi", **kw)
    _assert_no_blocks_used(cluster, within_s=0)


def test_empty_prompt_and_unknown_role(cluster):
    with TandemClient(cluster.address, timeout=10) as client:
        with pytest.raises(InvalidRequest, match="prompt"):
            list(client.generate(prompt=""))
        with pytest.raises(InvalidRequest, match="role"):
            list(client.generate(messages=[{"role": "robot", "content": "hi"}]))


def test_cancel_and_deadline_free_every_block(cluster):
    with TandemClient(cluster.address) as client:
        stream = client.generate(messages=[{"role": "user", "content": "go"}], max_tokens=4000,
                                 ignore_eos=True)  # fmt: skip
        next(stream)
        next(stream)
        stream.close()  # the client goes away mid-stream
    _assert_no_blocks_used(cluster)
    with TandemClient(cluster.address) as client, pytest.raises(DeadlineExceeded):
        # 3,000 tokens take ~4 s here: 0.3 s leaves room for a machine many times faster.
        list(client.generate(prompt="slow " * 50, max_tokens=3000, ignore_eos=True, timeout=0.3))
    _assert_no_blocks_used(cluster)


def test_every_process_reports_serving_to_the_standard_health_client(cluster):
    channels = [grpc.insecure_channel(cluster.address)]  # the router's port: plaintext on loopback
    channels += [cluster.dial(w.ready["grpc"]) for w in _workers(cluster)]  # mutual TLS
    for ch in channels:
        with ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.slow
def test_default_model_through_the_cluster_equals_colocated_and_hf(
    tmp_path_factory, smol_engine, smol_hf
):
    from tests.parity import assert_parity, hf_greedy

    params = SamplingParams(max_tokens=24, temperature=0)
    with _cluster(tmp_path_factory, "smol", model="smollm2-135m-instruct", num_blocks=512) as c:
        for text in PROMPTS:
            tokens, out, _ = _remote(c.address, text, max_tokens=24, temperature=0)
            ids = smol_engine.tokenizer.encode_chat([{"role": "user", "content": text}])
            colocated = list(smol_engine.stream(ids, params))
            assert tokens == [t for o in colocated for t in o.token_ids]
            assert out == "".join(o.text for o in colocated)
            assert_parity(
                smol_hf, ids, tokens, hf_greedy(smol_hf, ids, 24, smol_engine.eos_token_ids)
            )


def test_conditional_cluster_prefills_short_prompts_on_decode_and_long_ones_remotely(
    tmp_path_factory, tiny_engine
):
    """Real processes, 1 + 1, conditional: both paths give the colocated engine's tokens."""
    disagg = {"mode": "conditional", "local_max_tokens": 64}
    router = {"disaggregation": DisaggregationConfig(**disagg)}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with _cluster(tmp_path_factory, "cond", router=router) as c:
        prefill_w, decode_w = _workers(c)
        before = _status(c, prefill_w), _status(c, decode_w)
        short, long = PROMPTS[0], PROMPTS[2]  # 20-odd and 180-odd chat tokens
        for text in (short, long):
            tokens, out, _ = _remote(c.address, text, max_tokens=12, temperature=0,
                                     ignore_eos=True)  # fmt: skip
            assert (tokens, out) == _colocated(tiny_engine, text, params)
        after = _status(c, prefill_w), _status(c, decode_w)
        assert after[1].prefilled_here - before[1].prefilled_here == 1  # the short one
        assert after[0].served - before[0].served == 1  # the long one
        assert after[1].kv_transfers_total - before[1].kv_transfers_total == 1
        assert after[1].served - before[1].served == 2
        _assert_no_blocks_used(c)


def test_colocated_cluster_has_no_prefill_pool_and_moves_no_kv(tmp_path_factory, tiny_engine):
    router = {"disaggregation": DisaggregationConfig(mode="never")}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with _cluster(tmp_path_factory, "coloc", prefill=0, decode=1, router=router) as c:
        (decode_w,) = _workers(c)
        for text in PROMPTS:
            tokens, out, _ = _remote(c.address, text, max_tokens=12, temperature=0,
                                     ignore_eos=True)  # fmt: skip
            assert (tokens, out) == _colocated(tiny_engine, text, params)
        status = _status(c, decode_w)
        assert status.prefilled_here == status.served == len(PROMPTS)
        assert status.kv_transfers_total == 0
        assert status.prefix_query_tokens > 0
        _assert_no_blocks_used(c)


def test_a_cluster_without_prefill_workers_must_say_where_prompts_go():
    with pytest.raises(ConfigError, match="no prefill worker needs router.disaggregation.mode"):
        ClusterConfig(num_prefill=0)


def test_prefix_aware_colocated_cluster_keeps_each_system_prompt_on_one_worker(
    tmp_path_factory, tiny_engine
):
    """Two colocated workers, two long system prompts, several users each: every
    conversation goes where its system prompt is cached, and finds it there."""
    router = {"disaggregation": DisaggregationConfig(mode="never"), "placement": "prefix-aware"}
    systems = [f"You are assistant number {i}. " + "Follow these rules carefully. " * 12
               for i in range(2)]  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with _cluster(tmp_path_factory, "prefix", prefill=0, decode=2, router=router) as c:
        for user in range(4):
            for system in systems:
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": f"question {user}"}]  # fmt: skip
                with TandemClient(c.address, timeout=60) as client:
                    chunks = list(client.generate(messages=messages, max_tokens=4,
                                                  temperature=0, ignore_eos=True))  # fmt: skip
                ids = tiny_engine.tokenizer.encode_chat(messages)
                outs = list(tiny_engine.stream(ids, params))
                assert [t for ch in chunks for t in ch.token_ids] == [
                    t for o in outs for t in o.token_ids
                ]
        statuses = [_status(c, w) for w in _workers(c)]
        assert sorted(s.served for s in statuses) == [4, 4]  # one system prompt each
        # After the first of each, 3 of 4 conversations find ~all of their prompt cached.
        hit = sum(s.prefix_hit_tokens for s in statuses)
        query = sum(s.prefix_query_tokens for s in statuses)
        assert hit / query > 0.6, (hit, query)
        _assert_no_blocks_used(c)


def _scrape_all(c: LocalCluster) -> dict[str, list]:
    return {name: scrape(address) for name, address in c.metrics_targets().items()}


def test_metrics_of_every_process_add_up_to_a_known_workload(cluster):
    """Counters move by exactly what was sent; a repeated long prefix is a prefix hit."""
    assert set(cluster.metrics_targets()) == {"router", "prefill-0", "prefill-1", "decode-0",
                                              "decode-1"}  # fmt: skip
    _assert_no_blocks_used(cluster)
    before = _scrape_all(cluster)
    shared = "the same long system prompt, repeated for every user. " * 12
    usage = []
    with TandemClient(cluster.address, timeout=60) as client:
        for i in range(12):  # one after another: each prefill worker sees the prefix again
            chunks = list(client.generate(prompt=shared + f"user {i}", max_tokens=4 + i % 3,
                                          ignore_eos=True))  # fmt: skip
            usage.append(chunks[-1].usage)
    _assert_no_blocks_used(cluster)
    after = _scrape_all(cluster)

    def moved(process: str, name: str, **labels) -> float:
        return total(after[process], name, **labels) - total(before[process], name, **labels)

    n = len(usage)
    assert moved("router", "tandem_router_requests_total", code="OK", finish_reason="length") == n
    assert moved("router", "tandem_router_requests_total") == n
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "time_per_output_token_seconds", "queue_time_seconds"):  # fmt: skip
        assert moved("router", f"tandem_router_{histogram}_count") == n, histogram
    completion = sum(u.completion_tokens for u in usage)
    assert moved("router", "tandem_router_prompt_tokens_total") == sum(
        u.prompt_tokens for u in usage
    )
    assert moved("router", "tandem_router_generation_tokens_total") == completion
    # Every response after a request's first is one inter-token gap (one token each here).
    assert moved("router", "tandem_router_inter_token_latency_seconds_count") == completion - n
    assert total(after["router"], "tandem_router_requests_in_flight") == 0
    prefill = [p for p in after if p.startswith("prefill")]
    decode = [p for p in after if p.startswith("decode")]
    assert sum(moved(p, "tandem_worker_requests_served_total") for p in prefill) == n
    assert sum(moved(p, "tandem_worker_kv_transfers_total") for p in decode) == n
    assert sum(moved(p, "tandem_worker_kv_transfer_seconds_count") for p in prefill) == n
    sent = sum(moved(p, "tandem_worker_kv_transfer_bytes_total", direction="sent")
               for p in prefill)  # fmt: skip
    received = sum(moved(p, "tandem_worker_kv_transfer_bytes_total", direction="received")
                   for p in decode)  # fmt: skip
    assert sent == received > 0
    # Decode workers sample every token but the first (the prefill worker's).
    assert sum(moved(p, "tandem_worker_generated_tokens_total") for p in decode) == completion - n
    for p in prefill + decode:
        assert total(after[p], "tandem_worker_kv_blocks_used") == 0, p
        assert total(after[p], "tandem_worker_kv_usage_ratio") == 0, p
        assert total(after[p], "tandem_worker_kv_blocks_capacity") == 256, p
    for p in prefill:  # each worker computes the shared prefix once, then finds it cached
        served = moved(p, "tandem_worker_requests_served_total")
        queries = moved(p, "tandem_worker_prefix_cache_query_tokens_total")
        hits = moved(p, "tandem_worker_prefix_cache_hit_tokens_total")
        if served:
            assert hits / queries > 0.9 * (served - 1) / served, (p, served, hits, queries)
    for p in decode:  # every prompt was shipped: its lookups there chose blocks to send
        queries = moved(p, "tandem_worker_prefix_cache_query_tokens_total")
        assert moved(p, "tandem_worker_prefix_cache_shipped_query_tokens_total") == queries > 0
        hits = moved(p, "tandem_worker_prefix_cache_hit_tokens_total")
        assert moved(p, "tandem_worker_prefix_cache_shipped_hit_tokens_total") == hits
    # Labels an operator filters by, and none per request.
    for p in prefill + decode:
        labels = {k for s in after[p] if s.name.startswith("tandem_") for k in s.labels}
        assert {"worker", "role", "model"} <= labels and "request_id" not in labels


def test_every_metric_the_dashboard_queries_is_in_a_scrape(cluster):
    from tests.deploy.test_dashboard import dashboard_metric_names

    scraped = set()
    for address in cluster.metrics_targets().values():
        scraped |= declared(fetch(address))
    assert dashboard_metric_names() - scraped == set()
    assert {m.name for m in METRICS} - scraped == set()  # and the README's list is whole


def test_tandem_top_renders_a_frame_of_the_running_cluster_without_a_tty(cluster):
    router = cluster.metrics_targets()["router"]
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "top", "--target", router, "--once",
         "--interval", "0.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    frame = out.stdout
    assert "\x1b[" not in frame  # no screen control without a TTY
    assert re.search(r"requests\s+0 in flight", frame), frame
    assert "TTFT p50" in frame and "ITL p50" in frame
    rows = [line for line in frame.splitlines() if re.match(r"(prefill|decode)-\S+\s", line)]
    assert len(rows) == 4, frame
    # Up, nothing queued or running, the decode step (once one ran), no KV in use.
    idle = r"\s1\s+0\s+0\s+(-|\d+ms)\s+\[\.{10}\]\s+0%"
    assert all(re.search(idle, row) for row in rows), frame
