"""Tensor-parallel workers in a real cluster, colocated and disaggregated: each worker
is one process per rank, and the pools may be of different widths.

What must hold: the cluster streams the tokens of one device, a decode worker
receives every rank's share of a prompt's KV, and a rank that dies takes its whole
worker down, so the router treats it as one worker's death (its streams move to the
other worker and go on exactly) and no rank is left behind.
"""

from __future__ import annotations

import os
import re
import signal

import psutil
import pytest
import torch

from tandem.config import DisaggregationConfig
from tandem.engine.kv_cache import bytes_per_block
from tandem.engine.sampling_params import SamplingParams
from tandem.worker.server import EXIT_ENGINE_STALLED, EXIT_RANK_LOST
from tests.e2e.test_cluster import (
    PROMPTS,
    _assert_no_blocks_used,
    _cluster,
    _colocated,
    _remote,
    _status,
    _workers,
)
from tests.e2e.test_resilience import (
    Streams,
    _assert_exact,
    _busiest_decode,
    _expected,
    _router_log,
)
from tests.processes import survivors

COLOCATED = {"disaggregation": DisaggregationConfig(mode="never")}


def test_tensor_parallel_workers_stream_one_devices_tokens_and_die_as_one(
    tmp_path_factory, tiny_engine
):
    n, max_tokens = 4, 400  # long streams: still in the batch when the victim is picked
    expected = _expected(tiny_engine, n, max_tokens)
    with _cluster(
        tmp_path_factory, "tp", prefill=0, decode=2, router=COLOCATED, tensor_parallel_size=2
    ) as c:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for text in PROMPTS:
            tokens, out, _ = _remote(c.address, text, max_tokens=24, temperature=0,
                                     ignore_eos=True)  # fmt: skip
            assert (tokens, out) == _colocated(tiny_engine, text, params)

        streams = Streams(c.address, n, max_tokens)
        victim = _busiest_decode(c)
        (rank,) = psutil.Process(victim.popen.pid).children()  # rank 1: rank 0's child
        os.kill(rank.pid, signal.SIGKILL)
        assert victim.popen.wait(timeout=30) == EXIT_RANK_LOST
        streams.join()
        _assert_exact(streams, expected)
        assert re.search(rf"decode worker {victim.ready['grpc']} is down", _router_log(c))
        assert "tensor-parallel rank 1 exited with code -9" in victim.log_path.read_text()
        c.processes.remove(victim)
        _assert_no_blocks_used(c, within_s=30)
        ranks = [psutil.Process(p.popen.pid).children() for p in c.processes]
    # Stopping the cluster ends the other worker's rank too.
    assert survivors([r for rs in ranks for r in rs], within_s=15) == []


def test_a_hung_engine_ends_its_worker_and_its_streams_migrate(tmp_path_factory, tiny_engine):
    """A rank that stops (SIGSTOP: alive and silent) leaves rank 0 waiting for ever in a
    step's all-reduce, and the worker still answers Status: only its watchdog tells it
    from a busy one. The worker exits, the streams on it move to the other decode
    worker and go on exactly, and the stopped rank is not left behind."""
    n, max_tokens = 4, 64
    expected = _expected(tiny_engine, n, max_tokens)
    with _cluster(
        tmp_path_factory, "tp-hang", prefill=0, decode=2, router=COLOCATED,
        tensor_parallel_size=2, decode_config={"engine_stall_timeout_s": 3},
    ) as c:  # fmt: skip
        victim = next(w for w in _workers(c) if w.name == "decode-0")
        (rank,) = psutil.Process(victim.popen.pid).children()
        os.kill(rank.pid, signal.SIGSTOP)  # before the streams: some are placed on it
        streams = Streams(c.address, n, max_tokens)
        assert victim.popen.wait(timeout=60) == EXIT_ENGINE_STALLED
        streams.join()
        _assert_exact(streams, expected)
        assert "migrating after 0 tokens" in _router_log(c)
        log = victim.log_path.read_text()
        assert "(engine_stall_timeout_s 3): it is hung" in log
        assert "in all_reduce" in log  # the engine thread's stack: where it waits
        assert survivors([rank], within_s=10) == []
        c.processes.remove(victim)
        _assert_no_blocks_used(c, within_s=30)


@pytest.mark.parametrize("widths", [(2, 2), (2, 1), (1, 2)], ids=["2to2", "2to1", "1to2"])
def test_disaggregated_tensor_parallel_workers_move_every_ranks_kv(
    tmp_path_factory, tiny_engine, widths
):
    """Prefill and decode workers of 2 ranks each, or of 2 and 1, or 1 and 2: the decode
    worker reads every prefill rank's share of each prompt's KV (layer by layer, as
    the prefill computes it), into the ranks that hold those heads."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tok, cfg = tiny_engine.tokenizer, tiny_engine.model_config
    with _cluster(tmp_path_factory, "tp-split", widths=widths) as c:
        for text in PROMPTS:
            tokens, out, _ = _remote(c.address, text, max_tokens=24, temperature=0,
                                     ignore_eos=True)  # fmt: skip
            assert (tokens, out) == _colocated(tiny_engine, text, params)
        (prefill,) = [w for w in _workers(c) if w.name.startswith("prefill")]
        (decode,) = [w for w in _workers(c) if w.name.startswith("decode")]
        status = _status(c, decode)
        assert (_status(c, prefill).tensor_parallel_size, status.tensor_parallel_size) == widths
        assert status.kv_transfers_total == len(PROMPTS)
        # Each rank's share is its own heads: together, the whole model's KV of each prompt.
        prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS]
        blocks = sum(-(-len(p) // 16) for p in prompts)
        assert status.kv_bytes_total == blocks * bytes_per_block(cfg, 16, torch.float32)
        _assert_no_blocks_used(c)
