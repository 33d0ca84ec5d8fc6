"""Both ends of ``tandem bench transfer --path backend``: Tandem's own KV transfer backend.

Where ``ucx_pair.py`` times bare ucxx messages, this times what a request really
costs between a prefill and a decode worker: the sender checksums the request's
blocks where they lie and sends a header; the receiver reads the blocks out of the
sender's cache into its reserved ones (mapped, or with UCX gets: ``read``),
verifies them there and acks. One round trip is ``send()`` until its future
resolves with the receiver's ack.

The receiver runs in a spawned process driven over a pipe (``ReceiverProcess``);
the blocks it reserves and the arrival it reports are untimed bookkeeping.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

import torch

from tandem.errors import TandemError

WAIT_S = 60.0


def fingerprint(shape, dtype: torch.dtype, device: str = "cpu"):
    from tandem.kv_transfer import Fingerprint
    from tandem.kv_transfer.device_checksum import algorithm_for

    return Fingerprint(
        model="tandem-bench",
        dtype=str(dtype).removeprefix("torch."),
        num_layers=shape.layers,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        block_size=shape.block_size,
        checksum=algorithm_for(device),
        kv_cache_dtype="int8" if dtype == torch.int8 else "auto",
    )


def kv_tensor(
    shape, num_blocks: int, dtype: torch.dtype, random: bool, device: str = "cpu"
) -> torch.Tensor:
    """A paged KV cache laid out as the engine's, the null block last and always zero,
    allocated as a prefill worker's is (ucx/rma.py: UCX shared memory on the host)."""
    from tandem.kv_transfer.ucx.rma import allocate_kv

    dims = (shape.layers, 2, num_blocks + 1, shape.block_size, shape.kv_heads, shape.head_dim)
    kv = allocate_kv(dims, dtype, torch.device(device))
    if random:
        kv.copy_(torch.randn(dims, generator=torch.Generator().manual_seed(0)).to(dtype))
        kv[:, :, -1] = 0
    return kv


def _receiver_main(
    conn, read: str, shape, num_blocks: int, dtype: torch.dtype, device: str
) -> None:
    from tandem.engine.block_manager import BlockPool
    from tandem.kv_transfer import TransferState, make_receiver

    kv = kv_tensor(shape, num_blocks, dtype, random=False, device=device)
    pool = BlockPool(num_blocks, shape.block_size)
    receiver = make_receiver(
        "ucx", kv, fingerprint(shape, dtype, device), map_peers=read == "mapped"
    )
    blocks: dict[str, list[int]] = {}

    def expect(request_id: str, n: int):
        blocks[request_id] = pool.allocate(n)
        return receiver.expect(request_id, blocks[request_id], lease_s=WAIT_S)

    def finish(request_id: str, read_back: bool) -> bytes:
        status = receiver.poll(request_id)
        if status.state is not TransferState.DONE:
            raise TandemError(f"request {request_id} ended {status.state.value}: {status.reason}")
        ids = blocks.pop(request_id)
        arrived = b""
        if read_back:
            arrived = kv[:, :, ids].cpu().contiguous().view(torch.uint8).numpy().tobytes()
        receiver.release(request_id)
        pool.free(ids)
        return arrived

    commands = {"address": lambda: receiver.address, "expect": expect, "finish": finish}
    try:
        while True:
            name, *args = conn.recv()
            if name == "stop":
                break
            try:
                conn.send(("ok", commands[name](*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        receiver.close()
        conn.send(("ok", None))


class ReceiverProcess:
    """The decode worker's role, in a child process (spawned: ucxx must not be forked)."""

    def __init__(
        self, read: str, shape, num_blocks: int, dtype: torch.dtype, device: str = "cpu"
    ) -> None:
        """``read``: how the receiver reads the sender's blocks, "mapped" or "get"."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_receiver_main,
            args=(child, read, shape, num_blocks, dtype, device),
            daemon=True,
        )
        self.process.start()
        child.close()

    def __call__(self, name: str, *args: Any) -> Any:
        self.conn.send((name, *args))
        if not self.conn.poll(WAIT_S):
            raise TandemError(f"transfer benchmark: the receiver did not answer {name!r}")
        kind, value = self.conn.recv()
        if kind == "error":
            raise TandemError(f"transfer benchmark: receiver failed:\n{value}")
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self("stop")
            except (OSError, EOFError, TandemError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.conn.close()


def round_trips(sender, receiver: ReceiverProcess, blocks: int, split: str, n: int, tag: str):
    """Time ``n`` requests of ``blocks`` blocks each.

    Returns the seconds of each and the bytes of the blocks the last one filled.

    With ``split == "layer"`` each layer goes as its own message (send_layers), as a
    prefill that overlaps transfer with compute would send them.
    """
    src = list(range(blocks))
    layers = sender.kv.shape[0]
    times, arrived = [], b""
    for i in range(n):
        dest = receiver("expect", f"{tag}-{i}", blocks)
        start = time.perf_counter()
        if split == "layer":
            for layer in range(layers - 1):
                sender.send_layers(dest, src, (layer, layer + 1))
            future = sender.send(dest, src, first_token=1, layers=(layers - 1, layers))
        else:
            future = sender.send(dest, src, first_token=1)
        future.result(timeout=WAIT_S)
        times.append(time.perf_counter() - start)
        arrived = receiver("finish", f"{tag}-{i}", i == n - 1)
    return times, arrived
