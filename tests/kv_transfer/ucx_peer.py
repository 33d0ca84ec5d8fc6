"""A worker process for UCX tests: a receiver or sender driven over a multiprocessing pipe.

Started with the "spawn" context (``PeerProcess``). Commands are tuples
``(name, *args)``; every command gets one reply, ``("ok", value)`` or
``("error", TransferError | Exception)``.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

from tandem.kv_transfer import TransferError, make_receiver, make_sender
from tests.kv_transfer.conftest import fingerprint, make_side


def _receiver_main(
    conn,
    num_blocks: int,
    read_delay_s: float,
    fp_overrides: dict,
    secret: bytes | None,
    map_peers: bool,
) -> None:
    if read_delay_s:
        # A slow read into the blocks keeps a transfer "in flight" long enough to kill it.
        from tandem.kv_transfer.ucx.rma import CacheMemory

        real = CacheMemory.read

        def slow(*args) -> None:
            time.sleep(read_delay_s)
            real(*args)

        CacheMemory.read = slow
    side = make_side(num_blocks)
    receiver = make_receiver(
        "ucx", side.kv, fingerprint(**fp_overrides), secret=secret, map_peers=map_peers
    )
    commands = {
        "address": lambda: receiver.address,
        "allocate": lambda n: side.pool.allocate(n),
        "free": lambda ids: side.pool.free(ids),
        "expect": receiver.expect,
        "poll": receiver.poll,
        "release": receiver.release,
        "abort": receiver.abort,
        "blocks": lambda ids: side.kv[:, :, list(ids)].clone(),
        "metrics": lambda: receiver.metrics,
        "check_clean": side.check_clean,
        "live": lambda: receiver.core.num_live,
        # How each connected sender's cache is read: True mapped, False UCX gets.
        "mapped": lambda: [c.remote.mapped for c in receiver._connections if c.remote],
        # Whether each connected sender's frames and acks go through a mailbox.
        "mailbox": lambda: [c.mailbox is not None for c in receiver._connections if c.remote],
    }
    _serve(conn, commands)
    receiver.close()


def _sender_main(conn, num_blocks: int, seed: int, secret: bytes | None) -> None:
    side = make_side(num_blocks, seed=seed, ucx=True)
    sender = make_sender("ucx", side.kv, fingerprint(), secret=secret)
    futures: dict[str, Any] = {}

    def send(dest, src_ids, first_token):
        futures[dest.request_id] = sender.send(dest, src_ids, first_token)

    commands = {
        "allocate": lambda n: side.pool.allocate(n),
        "connect": sender.connect,
        "metrics": lambda: sender.metrics,
        "send_layers": sender.send_layers,
        "send": send,
        "result": lambda rid, timeout: futures.pop(rid).result(timeout),
    }
    _serve(conn, commands)
    sender.close()


def _serve(conn, commands) -> None:
    while True:
        name, *args = conn.recv()
        if name == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[name](*args)))
        except (TransferError, AssertionError, KeyError, ValueError) as exc:
            conn.send(("error", exc))
        except Exception as exc:
            conn.send(("error", RuntimeError(traceback.format_exc())))
            raise exc


class PeerProcess:
    """The test side of a helper process."""

    def __init__(self, role: str, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        target = _receiver_main if role == "receiver" else _sender_main
        defaults = (
            {
                "num_blocks": 128,
                "read_delay_s": 0.0,
                "fp_overrides": {},
                "secret": None,
                "map_peers": True,
            }
            if role == "receiver"
            else {"num_blocks": 128, "seed": 0, "secret": None}
        )
        defaults.update(kwargs)
        self.process = ctx.Process(target=target, args=(child,), kwargs=defaults, daemon=True)
        self.process.start()
        child.close()

    def __call__(self, name: str, *args: Any, timeout: float = 30.0) -> Any:
        self.conn.send((name, *args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {name} within {timeout} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise value
        return value

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self("stop", timeout=10)
            except (OSError, EOFError, TimeoutError):
                pass
            self.process.join(10)
        self.kill()
        self.conn.close()
