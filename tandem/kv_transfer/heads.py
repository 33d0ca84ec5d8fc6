"""KV between tensor-parallel workers of different widths: which heads go where.

A worker of width N keeps every rank's cache on the host as one tensor of N x L
layers (tandem/engine/parallel.py, ``SharedCache``): rank r's layer l is layer
``r * L + l``, and holds that rank's KV heads (``kv_head_slice``) inside each
token's row. Between workers of the same width, layer v goes to layer v and the
transfer is a plain block copy. Between different widths a message still names
the sender's layers (one sender rank's at a time: the sender cuts its messages at
rank boundaries), and the receiver assembles its ranks' heads from them:

    sender rank r_p, layer l            receiver: for each ``Piece`` of ``reads(r_p)``
      [blocks, block_size, heads_p, row]  heads [src_head, +count) of the sender's row
                                          -> receiver rank dst_rank's layer l, heads
                                             [dst_head, +count) of its row: a strided
                                             copy into the reserved blocks, from the
                                             mapped cache or what UCX gets staged
                                          then ``replicas(r_p)``: heads that more than
                                          one receiver rank holds (fewer KV heads than
                                          ranks) copied from where they landed

Each KV head is read once, from the first sender rank that holds it (a sender with
fewer KV heads than ranks holds each on several; the other copies' messages are
not read). Integrity: the sender's checksum covers its rank's blocks as they lie;
the receiver hashes the same bytes as they reached it: the staging buffer that
UCX gets filled (the heads are copied out of it locally), or, from a mapped cache,
the sender's blocks right after the copy (a block that changed before or during
the copy fails the digest; the sender keeps them unchanged until the ack). Hashing
what landed instead would gather each token's heads back from the receiver ranks:
another copy of every byte.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from tandem.kv_transfer.payload import block_runs, paired_runs

# The widest worker a peer may claim to be (a KV handshake refuses more).
MAX_WIDTH = 1024


def width_problem(width: object, num_kv_heads: int) -> str:
    """'' if ``width`` ranks can split ``num_kv_heads`` KV heads (``kv_head_slice``),
    else why not: a peer's claimed width is checked before anything is built on it."""
    if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= MAX_WIDTH:
        return f"{width!r} is not a width from 1 to {MAX_WIDTH}"
    if num_kv_heads % width and width % num_kv_heads:
        return f"{width} ranks do not split {num_kv_heads} KV heads"
    return ""


def kv_head_slice(rank: int, size: int, num_kv_heads: int) -> slice:
    """The KV heads rank ``rank`` of ``size`` holds: a contiguous 1/size of them, or,
    with fewer KV heads than ranks (size a multiple of them), the one head its query
    heads read, replicated on size / num_kv_heads ranks."""
    if num_kv_heads >= size:
        n = num_kv_heads // size
        return slice(rank * n, (rank + 1) * n)
    head = rank // (size // num_kv_heads)
    return slice(head, head + 1)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Heads [src_head, src_head + count) of rank src_rank's row go to heads
    [dst_head, dst_head + count) of rank dst_rank's row (local head indices)."""

    src_rank: int
    src_head: int
    dst_rank: int
    dst_head: int
    count: int


def _pieces(pairs: list[tuple[int, int, int, int]]) -> tuple[Piece, ...]:
    """(src rank, src head, dst rank, dst head) per head, merged into runs."""
    out: list[Piece] = []
    for sr, sh, dr, dh in pairs:
        last = out[-1] if out else None
        if (
            last is not None
            and (last.src_rank, last.dst_rank) == (sr, dr)
            and (last.src_head + last.count, last.dst_head + last.count) == (sh, dh)
        ):
            out[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            out.append(Piece(sr, sh, dr, dh, 1))
    return tuple(out)


class HeadMap:
    """How a cache of ``src_ranks`` ranks feeds one of ``dst_ranks`` ranks, for a model
    of ``num_layers`` layers and ``num_kv_heads`` KV heads (both widths split it)."""

    def __init__(self, num_layers: int, num_kv_heads: int, src_ranks: int, dst_ranks: int):
        self.num_layers = num_layers
        self.src_layers = src_ranks * num_layers
        src = [kv_head_slice(r, src_ranks, num_kv_heads) for r in range(src_ranks)]
        dst = [kv_head_slice(r, dst_ranks, num_kv_heads) for r in range(dst_ranks)]
        self.src_heads = src[0].stop - src[0].start  # per rank
        holders = {  # global head -> every (dst rank, local head) holding it
            g: [(r, g - s.start) for r, s in enumerate(dst) if s.start <= g < s.stop]
            for g in range(num_kv_heads)
        }
        self._reads: list[tuple[Piece, ...]] = []
        self._replicas: list[tuple[Piece, ...]] = []
        for r, s in enumerate(src):
            # A head another sender rank holds too is read from the first of them.
            if any(o.start <= s.start < o.stop for o in src[:r]):
                self._reads.append(())
                self._replicas.append(())
                continue
            heads = range(s.start, s.stop)
            self._reads.append(_pieces([(r, g - s.start, *holders[g][0]) for g in heads]))
            self._replicas.append(
                _pieces([(*holders[g][0], *h) for g in heads for h in holders[g][1:]])
            )

    def rank_of(self, layer: int) -> tuple[int, int]:
        """(sender rank, model layer) of the sender's layer ``layer``."""
        return divmod(layer, self.num_layers)

    def reads(self, src_rank: int) -> tuple[Piece, ...]:
        """What of sender rank ``src_rank`` lands where, in its heads' order; () when its
        heads are read from another sender rank."""
        return self._reads[src_rank]

    def replicas(self, src_rank: int) -> tuple[Piece, ...]:
        """Receiver-to-receiver copies (src_rank here: a receiver rank) of the heads
        ``reads(src_rank)`` landed, for the receiver ranks that hold them too."""
        return self._replicas[src_rank]

    def copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        src_block_ids: tuple[int, ...],
        dst_block_ids: tuple[int, ...],
        layers: tuple[int, int],
    ) -> None:
        """Copy the sender's blocks of ``layers`` (one sender rank's) into ``dst``'s
        blocks, head slice by head slice (one strided copy per run of blocks and
        piece, all the layers at once), then the heads that several receiver ranks
        hold from where they landed. ``src`` holds those layers only ([layers, 2,
        blocks, ...]: the layers of a mapped cache, or what UCX gets staged)."""
        rank, first_layer = self.rank_of(layers[0])
        count = layers[1] - layers[0]  # all of them the sender rank's: one copy per piece

        def on(dst_rank: int) -> torch.Tensor:  # those layers on a receiver rank
            start = dst_rank * self.num_layers + first_layer
            return dst[start : start + count]

        for p in self.reads(rank):
            to, heads_in, heads_out = on(p.dst_rank), _heads(p.src_head, p), _heads(p.dst_head, p)
            for s, d, n in paired_runs(src_block_ids, dst_block_ids):
                to[:, :, d : d + n, :, heads_out].copy_(src[:, :, s : s + n, :, heads_in])
        for p in self.replicas(rank):
            source, to = on(p.src_rank), on(p.dst_rank)
            heads_in, heads_out = _heads(p.src_head, p), _heads(p.dst_head, p)
            for d, n in block_runs(dst_block_ids):
                to[:, :, d : d + n, :, heads_out].copy_(source[:, :, d : d + n, :, heads_in])


def _heads(first: int, piece: Piece) -> slice:
    return slice(first, first + piece.count)


@functools.lru_cache(maxsize=16)
def head_map(num_layers: int, num_kv_heads: int, src_ranks: int, dst_ranks: int) -> HeadMap:
    """The map between two widths (None of the work is per request)."""
    return HeadMap(num_layers, num_kv_heads, src_ranks, dst_ranks)
