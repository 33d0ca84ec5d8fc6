"""KV between tensor-parallel caches of different widths (heads.py): every head of
every token lands in each receiver rank that holds it, through the in-process
backend and both UCX read paths, and a corrupted head is caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.kv_transfer import TransferState, make_receiver, make_sender
from tandem.kv_transfer.base import KV_LAYOUT, Fingerprint
from tandem.kv_transfer.heads import HeadMap, Piece, kv_head_slice
from tandem.kv_transfer.payload import make_header
from tandem.kv_transfer.receiver import ReceiverCore
from tests.kv_transfer.conftest import fingerprint

LAYERS, KV_HEADS, BLOCKS, BLOCK_SIZE, ROW = 3, 4, 6, 4, 8
SRC_IDS, DST_IDS = (2, 3, 5), (4, 0, 1)
# Narrower and wider, each side replicating heads (8 ranks over 4 KV heads), both.
WIDTHS = [(2, 1), (1, 2), (4, 2), (2, 4), (8, 1), (1, 8), (8, 2), (2, 8)]


def _fingerprint(ranks: int) -> Fingerprint:
    return fingerprint(
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=ROW,
        block_size=BLOCK_SIZE,
        tensor_parallel_size=ranks,
    )


def _cache(logical: torch.Tensor, ranks: int, allocate=None) -> torch.Tensor:
    """A width-``ranks`` cache of the model's KV ``logical`` ([layers, 2, blocks + 1,
    block_size, kv_heads, row]): each rank's layers in turn, each of its heads only."""
    parts = [logical[..., kv_head_slice(r, ranks, KV_HEADS), :] for r in range(ranks)]
    whole = torch.cat(parts)
    if allocate is None:
        return whole.contiguous()
    out = allocate(tuple(whole.shape), whole.dtype, torch.device("cpu"))
    return out.copy_(whole)


def _logical(seed: int = 0) -> torch.Tensor:
    shape = (LAYERS, 2, BLOCKS + 1, BLOCK_SIZE, KV_HEADS, ROW)
    kv = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    kv[:, :, -1] = 0  # the null block
    return kv


def _expected(logical: torch.Tensor, ranks: int) -> torch.Tensor:
    want = torch.zeros_like(logical)
    want[:, :, list(DST_IDS)] = logical[:, :, list(SRC_IDS)]
    return _cache(want, ranks)


def _transfer(backend: str, src: int, dst: int, allocate=None, sent=None, **receiver_options):
    """``sent``: a dict that gets the KV bytes each sender rank's messages carried."""
    logical = _logical()
    sender_kv = _cache(logical, src, allocate)
    receiver_kv = _cache(torch.zeros_like(logical), dst, allocate)
    receiver = make_receiver(backend, receiver_kv, _fingerprint(dst), **receiver_options)

    def count(header, _block):
        rank = header.layer_start // LAYERS
        sent[rank] = sent.get(rank, 0) + header.nbytes

    hook = None if sent is None else count
    sender = make_sender(backend, sender_kv, _fingerprint(src), fault_hook=hook)
    try:
        dest = receiver.expect("r", DST_IDS, lease_s=30)
        for layer in range(LAYERS):  # layer-wise, as a prefill worker ships them
            sender.send_layers(dest, SRC_IDS, (layer, layer + 1))
        status = sender.send(dest, SRC_IDS, first_token=7).result(timeout=30)
        arrived = receiver.poll("r")
    finally:
        sender.close()
        receiver.close()
    return status, arrived, receiver_kv, logical


def test_each_head_is_read_once_from_the_first_rank_that_holds_it():
    narrow = HeadMap(LAYERS, KV_HEADS, 8, 2)  # sender: each head on 2 ranks
    assert [narrow.reads(r) for r in range(8)] == [
        (Piece(0, 0, 0, 0, 1),), (), (Piece(2, 0, 0, 1, 1),), (),
        (Piece(4, 0, 1, 0, 1),), (), (Piece(6, 0, 1, 1, 1),), (),
    ]  # fmt: skip
    wide = HeadMap(LAYERS, KV_HEADS, 2, 8)  # receiver: each head on 2 ranks
    assert wide.reads(1) == (Piece(1, 0, 4, 0, 1), Piece(1, 1, 6, 0, 1))
    assert wide.replicas(1) == (Piece(4, 0, 5, 0, 1), Piece(6, 0, 7, 0, 1))
    assert HeadMap(LAYERS, KV_HEADS, 1, 2).reads(0) == (Piece(0, 0, 0, 0, 2), Piece(0, 2, 1, 0, 2))


@pytest.mark.parametrize(("src", "dst"), WIDTHS, ids=[f"{s}to{d}" for s, d in WIDTHS])
def test_every_head_lands_in_every_rank_that_holds_it(src, dst):
    sent: dict[int, int] = {}
    status, arrived, kv, logical = _transfer("inproc", src, dst, sent=sent)
    assert status.state is TransferState.DONE
    assert (arrived.state, arrived.first_token) == (TransferState.DONE, 7)
    assert torch.equal(kv, _expected(logical, dst))
    # Each sender rank sent its own heads' share.
    heads = KV_HEADS // src if src <= KV_HEADS else 1
    assert sent == {r: LAYERS * 2 * len(SRC_IDS) * BLOCK_SIZE * heads * ROW * 4 for r in range(src)}
    # What moved is the model's KV of those blocks, once (a replicated head is read
    # from one sender rank, and copied between receiver ranks here).
    assert arrived.bytes == LAYERS * 2 * len(SRC_IDS) * BLOCK_SIZE * KV_HEADS * ROW * 4


@pytest.mark.parametrize("path", ["mapped", "get"])
@pytest.mark.parametrize(("src", "dst"), [(2, 1), (1, 8)], ids=["2to1", "1to8"])
def test_ucx_reads_re_split_heads_on_both_paths(src, dst, path):
    pytest.importorskip("ucxx")
    from tandem.kv_transfer.ucx.rma import allocate_kv

    status, arrived, kv, logical = _transfer(
        "ucx", src, dst, allocate_kv, map_peers=path == "mapped"
    )
    assert (status.state, arrived.state) == (TransferState.DONE, TransferState.DONE)
    assert torch.equal(kv, _expected(logical, dst))


def test_a_corrupted_head_fails_the_request_checksum():
    logical = _logical()
    sender_kv = _cache(logical, 2)
    receiver_kv = _cache(torch.zeros_like(logical), 1)

    def corrupt(header, block):
        if header.layer_start == LAYERS:  # rank 1's layers, after their checksum
            block[0, 0, 0] += 1

    receiver = make_receiver("inproc", receiver_kv, _fingerprint(1))
    sender = make_sender("inproc", sender_kv, _fingerprint(2), fault_hook=corrupt)
    try:
        dest = receiver.expect("r", DST_IDS, lease_s=30)
        with pytest.raises(Exception, match="checksum"):
            sender.send(dest, SRC_IDS, first_token=7).result(timeout=30)
        assert receiver.poll("r").reason == "checksum"
    finally:
        sender.close()
        receiver.close()


def test_a_message_across_ranks_is_refused():
    from tandem.kv_transfer.payload import HeaderError, check_fits

    kv = _cache(_logical(), 2)
    header = make_header("r", (LAYERS - 1, LAYERS + 1), SRC_IDS, DST_IDS, kv)
    with pytest.raises(HeaderError, match="spans ranks"):
        check_fits(header, _cache(_logical(), 1), (2 * LAYERS, LAYERS, KV_HEADS // 2))


def test_caches_split_over_devices_refuse_each_other_even_at_the_same_width():
    own = f"{KV_LAYOUT}; rank 0 of 2 only, not transferable"
    a = fingerprint(kv_layout=own, tensor_parallel_size=2)
    assert "kv_layout: prefill" in a.mismatches(a)
    assert _fingerprint(2).mismatches(_fingerprint(1)) == ""


@pytest.mark.parametrize(
    ("width", "why"),
    [(3, "3 ranks do not split 4 KV heads"), (0, "0 is not a width"), ("2", "'2' is not a width"),
     (10**6, "is not a width from 1 to 1024")],
)  # fmt: skip
def test_a_claimed_width_that_cannot_split_the_heads_is_refused_by_name(width, why):
    claimed = dataclasses.replace(_fingerprint(1), tensor_parallel_size=width)
    problem = claimed.mismatches(_fingerprint(2))
    assert problem.startswith("tensor_parallel_size: prefill") and why in problem


def test_a_receiver_whose_tensor_is_not_its_ranks_layers_refuses_another_width():
    receiver = ReceiverCore(_cache(_logical(), 1)[:2].contiguous(), _fingerprint(1), "here")
    assert "holds 2 layers, not tensor_parallel_size x num_layers = 3" in receiver.handshake(
        _fingerprint(2)
    )
    assert receiver.handshake(_fingerprint(1)) == ""  # the same width reads blocks as they are


def test_a_header_past_the_senders_layers_fails_the_request_and_a_broken_read_too():
    sender_kv = _cache(_logical(), 2)
    heads = HeadMap(LAYERS, KV_HEADS, 2, 1)
    core = ReceiverCore(_cache(torch.zeros_like(_logical()), 1), _fingerprint(1), "here")
    core.expect("past", DST_IDS, lease_s=30)
    past = make_header("past", (2 * LAYERS, 2 * LAYERS + 1), SRC_IDS, DST_IDS, sender_kv[:1])
    core.deliver(past, "peer", lambda: None, heads)
    assert (core.poll("past").reason, core.poll("past").detail) == (
        "bad header",
        f"layer range [{2 * LAYERS}, {2 * LAYERS + 1}) past {2 * LAYERS} layers",
    )
    core.expect("broken", DST_IDS, lease_s=30)
    ok = make_header("broken", (0, 1), SRC_IDS, DST_IDS, sender_kv)

    def broken():
        raise RuntimeError("shape mismatch")

    core.deliver(ok, "peer", broken, heads)
    assert core.poll("broken").reason == "read failed"
