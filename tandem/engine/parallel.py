"""Tensor parallelism: one engine's model split over N processes, one per device.

Layout (Megatron-style). Rank r of N holds, in every layer:
- query heads [r*H/N, (r+1)*H/N) of q_proj (column-parallel) and the matching
  input columns of o_proj (row-parallel);
- the KV heads those query heads read: a contiguous 1/N of them when N divides
  the KV heads, or, when there are fewer KV heads than ranks (N a multiple of
  them), the one KV head its query heads share, replicated on the N/KV ranks
  whose query heads read it;
- a 1/N slice of the MLP's intermediate width: gate/up column-parallel, down
  row-parallel.
So each rank attends over its own heads from its own KV cache (the KV of its KV
heads only), and the two row-parallel outputs per layer are summed over ranks
with one all-reduce each; a row-parallel bias is added on rank 0 alone.

The embedding, the norms and the LM head are replicated, not sharded by
vocabulary: a sharded head would need an all-gather of the logits every step,
and sampling (penalties, top-p, logprobs) wants whole rows in one place; for the
models tensor parallelism is for (7B and up) the embedding and head are 1-3% of
the weights. Only rank 0 computes logits.

Lockstep. Rank 0 is the engine: it schedules, and before computing each step it
sends every other rank the step's plan (token ids, positions, block tables:
``StepPlan``, plain lists) and what it did to its KV since the last one (blocks
zeroed, copies to and from the host tier: ``kv_op``), which each rank does to its
own, in the same order, first. Each rank builds the same tensors on its device
and runs the same forward, and the all-reduces keep the ranks in step. The block
pool and the host tier's bookkeeping live on rank 0 only: every rank's cache and
tier have the same number of blocks, so a block id means the same tokens on each.

Processes. Rank 0 (the worker process, or ``tandem generate``) starts ranks 1..N-1
as ``python -m tandem.engine.parallel`` children and sends each its messages over
the child's stdin, which is also the child's lifeline: when rank 0's end closes
(it closed it, or exited, however it ended) the child exits, even while loading or
meeting. Signals sent to the whole process group (Ctrl-C, a service's stop) are
rank 0's to act on: the others ignore SIGINT and SIGTERM. The all-reduces go over a
torch.distributed process group (gloo on CPU, bound to loopback; NCCL on CUDA) that
meets at a file store in a directory only this user can enter: a worker's ranks
share a machine (the Ray deployment packs them, STRICT_PACK). A rank that exits
ends its worker: rank 0's watcher calls ``on_lost`` (a worker stops itself, which
the router sees as one worker's death), and a collective in flight fails at once
(gloo: "connection closed by peer") instead of hanging. A failure on rank 0 inside
a step it has sent ends the group the same way: the others wait in that step's
all-reduces, and could only go on out of step.

KV transfer. On the host, rank 0 makes every rank's cache, in one shared segment
(``SharedCache``): the KV tensor a transfer backend sees is all ranks' layers, so
prefill and decode workers of the same width move each rank's heads to the rank
that holds them on the other side, with the backends as they are (the layer-wise
hook fires for layer i of every rank). Between different widths the decode side
re-splits the heads as it reads them (tandem/kv_transfer/heads.py: a strided read
per slice of heads, since heads lie inside a token's row in this cache layout).
Not yet: transfers between GPU caches (each rank's cache is on its own device; the
fingerprint marks such a cache not transferable, so any peer is refused at connect
time, by name).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import mmap
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tandem.deploy.lifeline import continue_when_orphaned
from tandem.engine.model_config import ModelConfig
from tandem.errors import ConfigError
from tandem.kv_transfer.heads import kv_head_slice

if TYPE_CHECKING:
    from tandem.config import EngineConfig
    from tandem.engine.model_runner import StepPlan

log = logging.getLogger(__name__)

# How long one rank waits for the others at an all-reduce. They are at most one
# layer apart, so only a wedged or dead rank reaches it (a dead one usually fails
# the collective at once).
COLLECTIVE_TIMEOUT_S = 300
# How long the ranks may take to load their weights and meet.
START_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``: which heads and which MLP slice it holds."""

    rank: int = 0
    size: int = 1

    def q_heads(self, cfg: ModelConfig) -> slice:
        n = cfg.num_heads // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, cfg: ModelConfig) -> slice:
        return kv_head_slice(self.rank, self.size, cfg.num_kv_heads)

    def intermediate(self, cfg: ModelConfig) -> slice:
        n = cfg.intermediate_size // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank sees it: its heads and MLP width, the whole hidden size."""
        if self.size == 1:
            return cfg
        kv = self.kv_heads(cfg)
        return dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // self.size,
            num_kv_heads=kv.stop - kv.start,
            intermediate_size=cfg.intermediate_size // self.size,
        )

    def part(self, name: str, cfg: ModelConfig) -> tuple[tuple[slice, ...] | None, bool]:
        """How this rank loads the Hugging Face tensor ``name``: the index of its part
        (None: the whole tensor), and whether it is zeroed (a row-parallel bias is
        added once, on rank 0). The loader reads only that part (loader.py)."""
        if self.size == 1 or not name.startswith("model.layers."):
            return None, False
        module, _, kind = name.rpartition(".")
        proj = module.split(".", 3)[-1]
        hd = cfg.head_dim
        q, kv, mlp = self.q_heads(cfg), self.kv_heads(cfg), self.intermediate(cfg)
        rows = {  # output rows (column-parallel): weight and bias sliced alike
            "self_attn.q_proj": slice(q.start * hd, q.stop * hd),
            "self_attn.k_proj": slice(kv.start * hd, kv.stop * hd),
            "self_attn.v_proj": slice(kv.start * hd, kv.stop * hd),
            "mlp.gate_proj": mlp,
            "mlp.up_proj": mlp,
        }
        cols = {  # input columns (row-parallel)
            "self_attn.o_proj": slice(q.start * hd, q.stop * hd),
            "mlp.down_proj": mlp,
        }
        if proj in rows:
            return (rows[proj],), False
        if proj in cols and kind == "weight":
            return (slice(None), cols[proj]), False
        return None, proj in cols and self.rank > 0


ONE_DEVICE = Shard()


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Refuse, naming each setting, a width that does not split this model."""
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"divide num_attention_heads ({cfg.num_heads})")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"divide num_key_value_heads ({kv}) or be a multiple of it")
    if cfg.intermediate_size % size:
        problems.append(f"divide intermediate_size ({cfg.intermediate_size})")
    if problems:
        raise ConfigError(f"tensor_parallel_size {size} must " + ", and ".join(problems))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: its own GPU (cuda:rank from rank 0's index), or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def rank_threads(config: EngineConfig, device: torch.device) -> int | None:
    """torch threads per rank: num_threads, or the CPU's cores shared out between ranks."""
    if config.num_threads or device.type != "cpu" or config.tensor_parallel_size == 1:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


class Collective:
    """The all-reduce between a worker's ranks (gloo on CPU, NCCL on CUDA), meeting at
    ``store``: a file in a directory only this user can enter (the ranks share a host),
    not a TCP port that anything on the network could reach while they meet."""

    def __init__(self, store: str, rank: int, size: int, device: torch.device) -> None:
        files = dist.FileStore(store, size)
        files.set_timeout(datetime.timedelta(seconds=START_TIMEOUT_S))
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL works on the current device
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group: Any = dist.ProcessGroupNCCL(files, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            # Loopback: gloo would otherwise listen where the host name resolves.
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.group = dist.ProcessGroupGloo(files, rank, size, options)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        self.group.allreduce([tensor]).wait()


# ---- messages: length-prefixed pickles over a follower's stdin ------------------------


def _send(stream: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _recv(stream: IO[bytes]) -> Any:
    """The next message, or None at end of file (rank 0 is done or gone)."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


# Every rank's KV cache in host memory that rank 0 made, where it is on the host (see
# SharedCache); tests turn it off to run the other path (each rank's own cache,
# changed by the operations rank 0 logs) on a CPU.
SHARE_HOST_CACHE = True


class SharedCache:
    """Every rank's KV cache in one shared-memory segment (a memfd) that rank 0 makes:
    ``[ranks x layers, 2, blocks + 1, block_size, kv_heads of a rank, row]``, rank r's
    layers at ``[r * layers, (r + 1) * layers)``. Each rank computes into its own part;
    rank 0 reaches them all, so it zeroes blocks, copies them to and from the host
    tier, and moves them to and from other workers (the KV transfer sees a cache of
    ranks x layers layers) for every rank itself. The segment has no name: the ranks
    get its descriptor when they start, and it is gone when the last of them is."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.fd = os.memfd_create("tandem-kv")  # close-on-exec; pass_fds hands it on
        os.ftruncate(self.fd, self.nbytes)
        self.tensor = _map_cache(self.fd, self.nbytes, shape, dtype)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """``KVCache``'s allocator: the segment, which has that shape already."""
        if tuple(shape) != self.shape or dtype != self.dtype:
            raise ValueError(f"the shared KV cache is {self.shape} {self.dtype}, not {shape}")
        return self.tensor

    def close(self) -> None:
        os.close(self.fd)  # the mapping (and the ranks') keeps the memory until unmapped


def _map_cache(fd: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype):
    memory = mmap.mmap(fd, nbytes)
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


@dataclasses.dataclass(frozen=True)
class _Start:
    config: EngineConfig
    rank: int
    store: str  # where the ranks meet (Collective)
    num_blocks: int
    host_blocks: int
    # The shared cache (its descriptor in the rank's process, shape, dtype), or None:
    # the rank makes its own.
    shared: tuple[int, tuple[int, ...], torch.dtype] | None = None


class TensorParallel:
    """Rank 0's side: starts ranks 1..N-1, sends them each step, watches them.

    ``on_lost(reason)`` runs on a watcher thread when a rank exits while this side
    still runs (a worker stops itself there); every later ``step`` raises.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        host_blocks: int,
        device: torch.device,
        on_lost: Callable[[str], None] | None = None,
        shared: SharedCache | None = None,
    ) -> None:
        """``shared``: every rank's cache, made by this rank (None: each makes its own,
        and the changes this rank makes to its cache outside a step go in ``kv_op``)."""
        self.size = config.tensor_parallel_size
        self.shared = shared
        self.on_lost = on_lost
        self.lost: str | None = None
        self._closing = False  # set once: by the one report of a loss, or by kill/close
        self._report_lock = threading.Lock()
        self._store_dir = tempfile.mkdtemp(prefix="tandem-tp-")  # 0700: this user's
        self._store = os.path.join(self._store_dir, "store")
        self._device = device
        self._ops: list[tuple] = []
        self._procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, self.size):
                # -P: not the working directory first on sys.path, where a file named
                # as a module the rank imports (mmap.py, a tandem/) would replace it.
                proc = subprocess.Popen(
                    [sys.executable, "-P", "-m", "tandem.engine.parallel"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    pass_fds=() if shared is None else (shared.fd,),
                )
                self._procs.append(proc)
                cache = None if shared is None else (shared.fd, shared.shape, shared.dtype)
                start = _Start(config, rank, self._store, num_blocks, host_blocks, cache)
                _send(proc.stdin, start)
        except BaseException:
            self.close(timeout_s=1)  # a rank may be loading, or waiting to meet this one
            raise
        finally:
            if shared is not None:
                shared.close()  # every rank has its own descriptor now

    def connect(self, timeout_s: float = START_TIMEOUT_S) -> Collective:
        """Wait until every rank has loaded its shard, then join their process group;
        ConfigError if a rank dies or is not ready within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        try:
            for rank, proc in enumerate(self._procs, start=1):
                left = max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([proc.stdout], [], [], left)
                if not ready:
                    raise ConfigError(
                        f"tensor-parallel rank {rank} was not ready within {timeout_s:g} s"
                    )
                line = proc.stdout.readline()  # "ready", or EOF if it died loading
                if line.strip() != b"ready":
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:  # closed its stdout but lives on
                        proc.kill()
                        proc.wait()
                    raise ConfigError(
                        f"tensor-parallel rank {rank} exited with code {proc.returncode} "
                        "while starting (its log is above)"
                    )
            collective = self._meet()
        except BaseException:
            self.close(timeout_s=1)  # a rank may be loading, or waiting to meet this one
            raise
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}", daemon=True
            ).start()
        return collective

    def _meet(self) -> Collective:
        """Rank 0's side of the ranks' meeting. A rank that exited after its "ready"
        (while rank 0 still loaded: the OOM killer) is named first: gloo would wait for
        it without limit in some runs (holding the GIL, so that no thread can watch),
        or fail on a refused connection that names no rank."""
        exited = self._exited()
        if exited:
            raise ConfigError(f"{exited} before the ranks met")
        try:
            return Collective(self._store, 0, self.size, self._device)
        except Exception as exc:
            exited = self._exited(wait_s=1.0)
            if exited:
                raise ConfigError(f"{exited} while the ranks met") from exc
            raise

    def _exited(self, wait_s: float = 0.0) -> str:
        """'tensor-parallel rank N exited with code C' for a rank that has exited ('' if
        none), a rank killed by a signal first: the others may have exited after it, for
        the collective it broke. ``wait_s``: how long to give a dying one to end."""
        deadline = time.monotonic() + wait_s
        while True:
            codes = [(proc.poll(), rank) for rank, proc in enumerate(self._procs, start=1)]
            gone = sorted((code >= 0, rank, code) for code, rank in codes if code is not None)
            if gone:
                _, rank, code = gone[0]
                return f"tensor-parallel rank {rank} exited with code {code}"
            if time.monotonic() >= deadline:
                return ""
            time.sleep(0.02)

    def _report(self, lost: str) -> bool:
        """Records ``lost`` as the group's loss if none was: the one report."""
        with self._report_lock:
            if self._closing:
                return False
            self._closing = True
            self.lost = lost
            return True

    def fail(self, reason: str) -> None:
        """Rank 0 failed inside a step it had sent: stop every other rank and report the
        worker lost (``on_lost``), as a rank's death is; every later ``step`` raises.
        A rank that exited (the likely cause) is named rather than the step's error."""
        if self._closing:  # reported already, or ending: no wait for a rank to exit
            return
        exited = self._exited(wait_s=0.5)
        if not self._report(exited or f"tensor-parallel group broken: {reason}"):
            return
        log.error("%s: this worker cannot compute any more", self.lost)
        for proc in self._procs:
            proc.kill()
        self._forget_store()
        if self.on_lost is not None:
            self.on_lost(self.lost)

    def kill(self) -> None:
        """End every other rank now, with no report from the watchers: SIGKILL, which a
        stopped or stuck rank cannot miss as it would the end of its stdin."""
        with self._report_lock:
            self._closing = True
        for proc in self._procs:
            proc.kill()
        self._forget_store()

    def _forget_store(self) -> None:
        """The group will never meet again (the worker is ending): its store goes now,
        since the process may end by ``os._exit``, with no ``close``."""
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        lost = self._exited() or f"tensor-parallel rank {rank} exited with code {code}"
        if not self._report(lost):
            return  # reported already (a rank it took with it, fail()), or closing
        self._forget_store()
        log.error("%s: this worker cannot compute without it", self.lost)
        if self.on_lost is not None:
            self.on_lost(self.lost)

    def kv_op(self, op: tuple) -> None:
        """A change rank 0 made to its KV outside a step (blocks zeroed, copied to or
        from the host tier): the others make it to theirs before the next step. Its
        lists are copied now: sent later, a list that changed since (a block table
        that grew) would name other blocks than rank 0's copy did."""
        self._ops.append(tuple(list(a) if isinstance(a, list) else a for a in op))

    def step(self, plan: StepPlan) -> None:
        """Send every other rank this step (call before computing it on rank 0)."""
        if self.lost:
            raise RuntimeError(self.lost)
        message = (self._ops, plan)
        self._ops = []
        for rank, proc in enumerate(self._procs, start=1):
            try:
                _send(proc.stdin, message)
            except (BrokenPipeError, OSError) as exc:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone: {exc}") from exc

    def close(self, timeout_s: float = 10.0) -> None:
        """End every other rank (end of file on its stdin) and wait ``timeout_s`` for them
        all, then kill those left."""
        self._closing = True
        for proc in self._procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        shutil.rmtree(self._store_dir, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def follower(stdin: IO[bytes], stdout: IO[bytes]) -> int:
    """Ranks 1..N-1: load this rank's shard, then run every step rank 0 sends."""
    from tandem import logs
    from tandem.engine.device import resolve_device, resolve_dtype
    from tandem.engine.engine import load_model, model_source
    from tandem.engine.kv_cache import KVCache, kv_cache_dtype
    from tandem.kernels import get_backend, resolve_backend

    start: _Start | None = _recv(stdin)
    if start is None:
        return 0
    watch = threading.Thread(target=_exit_when_orphaned, args=(stdin, start.store), daemon=True)
    watch.start()
    logs.configure(f"tp-rank-{start.rank}")
    config, shard = start.config, Shard(start.rank, start.config.tensor_parallel_size)
    device = rank_device(resolve_device(config.device), shard.rank)
    dtype = resolve_dtype(config.dtype, device)
    threads = rank_threads(config, device)
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches on the current device
    model_dir, cfg = model_source(config)
    model = load_model(config, model_dir, cfg, device, dtype, shard)
    model.lm_head = None  # only rank 0 computes logits: the head's memory goes here
    ops = get_backend(resolve_backend(config.attention_backend, device, config.cache_dir))
    if start.shared is not None:  # this rank's layers of rank 0's segment
        fd, shape, kv_dtype = start.shared
        layers = cfg.num_layers
        whole = _map_cache(fd, math.prod(shape) * kv_dtype.itemsize, shape, kv_dtype)
        os.close(fd)
        kv, cache = None, whole[shard.rank * layers : (shard.rank + 1) * layers]
    else:
        kv = KVCache(
            shard.config(cfg),
            start.num_blocks,
            config.block_size,
            kv_cache_dtype(config.kv_cache_dtype, dtype),
            device,
            enable_prefix_caching=False,
            host_blocks=start.host_blocks,
        )
        cache = kv.tensor
    stdout.write(b"ready\n")
    stdout.close()  # nothing else goes to rank 0 that way
    model.all_reduce = Collective(start.store, shard.rank, shard.size, device).all_reduce
    while (message := _recv(stdin)) is not None:
        kv_ops, plan = message
        for op in kv_ops:
            _apply(kv, op)
        input_ids, positions, meta = plan.inputs(device, start.num_blocks)  # the null block
        model(input_ids, positions, cache, meta, ops)
    return 0


def _apply(kv, op: tuple) -> None:
    """Make a change rank 0 made to its KV (``TensorParallel.kv_op``) to this rank's."""
    kind, *args = op
    if kind == "zero":
        kv.tensor.index_fill_(2, torch.tensor(args[0], device=kv.tensor.device), 0)
    elif kind == "out":
        kv.host.copy_out(kv.tensor, *args)
    elif kind == "in":
        kv.host.copy_in(kv.tensor, *args)
    else:
        raise ValueError(f"unknown KV operation {kind!r}")


def _exit_when_orphaned(stdin: IO[bytes], store: str) -> None:
    """Rank 0's end of this rank's stdin closed (it exited, however): end now, even
    while loading the weights or waiting for the others to meet, not at the next
    message; and take the group's store with it, which a rank 0 that ended by
    ``os._exit`` or a signal left behind."""
    hangup = select.poll()
    hangup.register(stdin.fileno(), 0)  # hang-ups and errors only
    while True:
        for _, event in hangup.poll():
            if event & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                shutil.rmtree(os.path.dirname(store), ignore_errors=True)
                os._exit(0)


def main() -> int:
    # Signals for the worker's process group (Ctrl-C, a service manager's SIGTERM)
    # are rank 0's to act on: it drains, then ends this rank through the lifeline.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    continue_when_orphaned()  # a stopped rank resumes to see rank 0 gone
    stdin = sys.stdin.buffer
    # fd 1 carries "ready" only; anything else written there (native libraries' logs)
    # goes to stderr, and never fills a pipe that rank 0 stops reading.
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        return follower(stdin, stdout)
    except Exception:
        log.exception("tensor-parallel rank failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
