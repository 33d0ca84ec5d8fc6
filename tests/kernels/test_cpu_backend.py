"""The cpu backend's build, its choice by ``auto``, and what its kernel does beyond the
shared cases of test_backends.py (threads, shapes it hands back to the reference)."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import pytest
import torch

from tandem.errors import ConfigError
from tandem.kernels import resolve_backend, torch_ref
from tandem.kernels.cpu import build
from tests.conftest import make_engine
from tests.kernels.conftest import cpu_backend_or_skip


@pytest.fixture
def cpu():
    return cpu_backend_or_skip()


def _decode_case(batch: int, heads: int, kv_heads: int, dim: int, context: int, dtype):
    gen = torch.Generator().manual_seed(0)
    block_size = 16
    blocks = -(-context // block_size)
    num_blocks = batch * blocks + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)[: batch * blocks]
    tables = order.view(batch, blocks)
    lens = torch.randint(1, context + 1, (batch,), generator=gen)
    lens[0] = context
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, lens, context, dim**-0.5


def test_decode_gives_the_same_bits_on_any_number_of_threads(cpu) -> None:
    # Each (sequence, KV head) is one task whatever the thread count: results must not
    # depend on how tasks fall on threads. More tasks than threads, and fewer.
    threads = torch.get_num_threads()
    try:
        for batch in (1, 5):
            case = _decode_case(batch, 9, 3, 64, 100, torch.bfloat16)
            torch.set_num_threads(1)
            one = cpu.decode_attention(*case)
            torch.set_num_threads(4)
            four = cpu.decode_attention(*case)
            assert torch.equal(one, four)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dim", [8, 24, 40])
def test_decode_handles_head_dims_of_any_multiple_of_8(cpu, dim) -> None:
    # The kernel works in vectors of 8 floats, its dot products two at a time: an odd
    # number of vectors (24, 40) takes the tail path, 8 a single vector.
    case = _decode_case(3, 6, 2, dim, 37, torch.float32)
    torch.testing.assert_close(
        cpu.decode_attention(*case), torch_ref.decode_attention(*case), rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_decode_softmax_holds_for_any_length_and_sharp_scores(cpu, scale) -> None:
    # The kernel's softmax exponentiates eight scores at a time (its own exp, within an
    # ulp of libm's) and the last len % 8 through the same exp: every length from 1 to
    # 40, and scores so spread (scale 40) that most weights underflow to zero.
    for context in range(1, 41):
        q, *rest, scale_ = _decode_case(2, 9, 3, 64, context, torch.float32)
        case = (q * scale, *rest, scale_)
        torch.testing.assert_close(
            cpu.decode_attention(*case), torch_ref.decode_attention(*case), rtol=2e-5, atol=2e-5
        )


def test_decode_reads_query_rows_with_a_stride(cpu) -> None:
    # The engine passes q as a slice of the fused projection's output (rows strided).
    q, *rest = _decode_case(3, 4, 2, 32, 40, torch.float32)
    wide = torch.randn(3, 7, 32)
    wide[:, :4] = q
    strided = wide[:, :4]
    assert not strided.is_contiguous()
    assert torch.equal(cpu.decode_attention(strided, *rest), cpu.decode_attention(q, *rest))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(34, 2, 32), (4, 2, 12)],
    ids=["17 query heads per KV head", "head_dim not a multiple of 8"],
)
def test_shapes_the_kernel_was_not_built_for_take_the_reference(cpu, heads, kv_heads, dim) -> None:
    case = _decode_case(2, heads, kv_heads, dim, 20, torch.float32)
    assert torch.equal(cpu.decode_attention(*case), torch_ref.decode_attention(*case))


def test_the_library_is_built_once_and_found_again(tmp_path: Path, cpu, monkeypatch) -> None:
    calls = []
    real_run = build.subprocess.run

    def run(cmd, **kwargs):
        calls.append(cmd)
        return real_run(cmd, **kwargs)

    monkeypatch.setattr(build.subprocess, "run", run)
    compiler = build.compiler()
    path = build.build(tmp_path, compiler)
    compiles = [c for c in calls if "-o" in c]
    assert len(compiles) == 1 and path.exists() and path.parent == tmp_path / "kernels"
    assert build.build(tmp_path, compiler) == path
    assert len([c for c in calls if "-o" in c]) == 1  # found, not rebuilt
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial files left


def test_cc_may_carry_arguments(tmp_path: Path, cpu, monkeypatch) -> None:
    # CC="ccache gcc" or "cc -pipe" was looked up on PATH whole, not found, and the
    # engine ran torch's slower ops with a warning in the log.
    monkeypatch.setattr(build, "_loaded", {})
    plain = build.compiler()
    monkeypatch.setenv("CC", shlex.join([*plain, "-pipe"]))
    assert build.compiler() == [*plain, "-pipe"]
    assert build.load(tmp_path) is not None
    # Its arguments may change what it builds: the library is the command's own.
    assert build.library_path(tmp_path, [*plain, "-pipe"]) != build.library_path(tmp_path, plain)


def test_a_cc_that_is_no_command_falls_back_as_no_compiler_does(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setenv("CC", 'gcc "-O2')  # an unbalanced quote: it failed the engine
    with caplog.at_level(logging.WARNING):
        assert build.load(tmp_path) is None
    assert "CC='gcc \"-O2' is not a command" in caplog.text


def test_without_a_compiler_auto_falls_back_and_cpu_is_refused(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    from tandem.kernels import cpu

    monkeypatch.setattr(cpu, "_kernels", {})
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING):
        assert resolve_backend("auto", torch.device("cpu"), tmp_path) == "torch"
    assert "no C compiler 'no-such-compiler'" in caplog.text
    with pytest.raises(ConfigError, match="attention_backend 'cpu' needs its C kernels"):
        resolve_backend("cpu", torch.device("cpu"), tmp_path)


def test_a_failed_build_is_reported_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    from tandem.kernels import cpu

    monkeypatch.setattr(cpu, "_kernels", {})
    monkeypatch.setattr(build, "_loaded", {})
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C;\n")
    monkeypatch.setattr(build, "SOURCES", (bad,))
    with caplog.at_level(logging.WARNING):
        assert not cpu.load(tmp_path)
    assert "CPU kernels unavailable" in caplog.text and "exited with" in caplog.text
    assert not any((tmp_path / "kernels").iterdir())


def test_a_first_load_that_failed_compiles_no_kernel_elsewhere(
    tmp_path: Path, cpu, monkeypatch
) -> None:
    # An engine's cache_dir that cannot hold the library turned the C attention off,
    # and then RMSNorm's first call compiled the library into the default cache (the
    # home directory) and ran it: the log said torch's ops, and a home was written.
    for name, value in (("_loaded", {}), ("_functions", {}), ("_first", None), ("_tried", False)):
        monkeypatch.setattr(build, name, value)
    monkeypatch.delenv("TANDEM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    (tmp_path / "a-file").write_text("")
    assert build.load(tmp_path / "a-file" / "cache") is None  # cannot be made
    assert build.function("tandem_rms_norm_bf16", []) is None
    assert not (tmp_path / "home-cache").exists()


def test_a_cached_library_that_does_not_load_is_compiled_again(tmp_path: Path, cpu, monkeypatch):
    # Cut short by a full disk or copied in half by a cache sync, it was found, failed
    # to load, and every later start ran torch's slower ops until someone deleted it.
    monkeypatch.setattr(build, "_loaded", {})
    path = build.library_path(tmp_path, build.compiler())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF" + bytes(60))
    assert build.load(tmp_path) is not None
    assert path.stat().st_size > 64


def test_cpu_backend_is_refused_on_other_devices() -> None:
    with pytest.raises(ConfigError, match="attention_backend 'cpu' runs on CPU devices"):
        resolve_backend("cpu", torch.device("cuda"))


def test_auto_is_the_cpu_backend_on_a_cpu_where_it_builds(cpu) -> None:
    # What every CPU engine test (HF parity included) then runs on.
    engine = make_engine()
    assert engine.attention_backend == "cpu"
    assert engine.runner.ops is cpu


def test_a_table_too_short_for_the_context_is_refused(cpu) -> None:
    q, k_cache, v_cache, tables, lens, context, scale = _decode_case(2, 4, 2, 32, 40, torch.float32)
    with pytest.raises(ValueError, match="block tables of 2 blocks cannot hold a context of 40"):
        cpu.decode_attention(q, k_cache, v_cache, tables[:, :2], lens, context, scale)
