"""The GGUF's 4-bit projections (tandem/engine/gguf_int4.py): read as stored, checked
against the weights the engine loads, used for small steps only, and close to the
dense bfloat16 weights in error; the AMX kernel (tandem/kernels/cpu/gguf_linear.c)
computes with exactly the dense weights."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import gguf_int4
from tandem.engine.engine import LLMEngine
from tandem.engine.gguf_int4 import GROUP, Q4_1, Q8_0
from tandem.engine.loader import load_state_dict, read_config, resolve_model, smollm2_gguf_path
from tandem.engine.model import Linear, LlamaModel
from tandem.engine.model_config import ModelConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.kernels.cpu.build import cpu_flags

pytestmark = pytest.mark.skipif(not gguf_int4.available(), reason="torch has no int4 CPU matmul")
needs_amx = pytest.mark.skipif(
    not gguf_int4.amx_available(), reason="this CPU (or its kernel build) has no AMX"
)
needs_f32 = pytest.mark.skipif(
    not gguf_int4.f32_available(), reason="the CPU kernels' library does not build here"
)


@pytest.fixture(scope="module")
def smol():
    """The default model in float32 (weights loaded, not cast) and its GGUF's codes."""
    model_dir = resolve_model("smollm2-135m-instruct")
    cfg = ModelConfig.from_hf(read_config(model_dir))
    model = LlamaModel(cfg, 64)
    model.load_hf_state_dict(load_state_dict(model_dir))
    return model, gguf_int4.read_q4_1(smollm2_gguf_path(), cfg.num_heads, cfg.num_kv_heads)


def _random_codes(rows: int, cols: int, seed: int = 0) -> Q4_1:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(rows, cols // GROUP, generator=gen) * 0.01).half().float()
    mins = (-torch.rand(rows, cols // GROUP, generator=gen) * 0.08).half().float()
    return Q4_1(codes, scales, mins)


def _random_q8_0(rows: int, cols: int, seed: int = 0) -> Q8_0:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return Q8_0(codes, (torch.rand(rows, cols // GROUP, generator=gen) * 1e-3).half().float())


def _linear_with_codes(
    codes: Q4_1 | Q8_0,
    max_rows: int,
    amx: bool = False,
    bias=False,
    dtype: torch.dtype = torch.bfloat16,
) -> Linear:
    rows, cols = codes.codes.shape
    linear = Linear(cols, rows, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(codes.dequantize())
    linear = linear.to(dtype)
    if isinstance(codes, Q8_0):
        linear.use_int4(gguf_int4.pack_q8_0(codes, dtype), max_rows)
    else:
        linear.use_int4(gguf_int4.pack(codes, dtype, amx), max_rows)
    return linear


def _torch_int4(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    forms = linear.int4
    return torch._weight_int4pack_mm_for_cpu(x, forms.packed, GROUP, forms.scales_and_zeros)


def test_steps_up_to_max_rows_read_the_codes_and_larger_ones_the_dense_weights() -> None:
    codes = _random_codes(96, 128)
    linear = _linear_with_codes(codes, max_rows=4)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 4, 5, 16):
        x = torch.randn(rows, 128, generator=gen).bfloat16()
        dense = torch.nn.functional.linear(x, linear.weight)
        assert torch.equal(linear(x), _torch_int4(linear, x) if rows <= 4 else dense), rows
    # Above 8 rows torch's kernel loses to the dense weights, whatever max_rows says.
    linear = _linear_with_codes(codes, max_rows=64)
    for rows in (8, 9):
        x = torch.randn(rows, 128, generator=gen).bfloat16()
        dense = torch.nn.functional.linear(x, linear.weight)
        assert torch.equal(linear(x), _torch_int4(linear, x) if rows <= 8 else dense), rows
    # The codes are the weights: what the kernel computes from them is their matmul.
    x = torch.randn(3, 128, generator=gen).bfloat16()
    exact = x.double() @ codes.dequantize().double().t()
    assert torch.allclose(linear(x).double(), exact, rtol=2e-2, atol=2e-2)


def _rounding_of_exact(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias=None):
    """Whether ``y`` is x @ weight.T (+ bias) computed exactly and rounded once to
    bfloat16, give or take one unit in the last place (float32 sums in some order)."""
    exact = x.double() @ weight.double().t()
    if bias is not None:
        exact = exact + bias.double()
    ulp = exact.abs().clamp_min(1e-30) * 2.0**-7
    return bool(((y.double() - exact).abs() <= ulp + 1e-6).all())


@needs_amx
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_amx_kernel_computes_with_exactly_the_dense_weights(fmt: str, bias: bool) -> None:
    codes = _random_codes(48, 96, seed=2) if fmt == "q4_1" else _random_q8_0(48, 96, seed=2)
    linear = _linear_with_codes(codes, max_rows=64, amx=True, bias=bias)
    if bias:
        with torch.no_grad():
            linear.bias.copy_(torch.randn(48).bfloat16())
    forms = linear.int4
    assert torch.equal(gguf_int4.amx_weights(forms), linear.weight)
    gen = torch.Generator().manual_seed(3)
    # Row counts inside one block of 16, at its edges, and over several blocks.
    for rows in (1, 3, 4, 15, 16, 17, 33, 64):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        y = gguf_int4.amx_linear(x, forms, linear.bias)
        assert y.shape == (rows, 48)
        assert _rounding_of_exact(y, x, linear.weight, linear.bias), rows
    # A strided x (a slice of a wider tensor) is read as its values, not its storage.
    wide = torch.randn(8, 192, generator=gen).bfloat16()
    assert torch.equal(
        gguf_int4.amx_linear(wide[:, ::2], forms, None),
        gguf_int4.amx_linear(wide[:, ::2].contiguous(), forms, None),
    )
    with pytest.raises(ValueError, match="amx_linear: x"):
        gguf_int4.amx_linear(torch.randn(2, 64).bfloat16(), forms, None)
    with pytest.raises(ValueError, match="amx_linear: bias"):  # the kernel would read past it
        gguf_int4.amx_linear(torch.randn(2, 96).bfloat16(), forms, torch.zeros(47).bfloat16())


@needs_amx
def test_steps_of_4_to_64_rows_run_the_amx_kernel_and_others_the_other_forms() -> None:
    codes = _random_codes(48, 96, seed=4)
    linear = _linear_with_codes(codes, max_rows=64, amx=True)
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 3, 4, 16, 64, 65):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        if rows < 4:
            expected = _torch_int4(linear, x)
        elif rows <= 64:
            expected = gguf_int4.amx_linear(x, linear.int4, None)
        else:
            expected = torch.nn.functional.linear(x, linear.weight)
        assert torch.equal(linear(x), expected), rows
    # max_rows caps the AMX kernel too.
    capped = _linear_with_codes(codes, max_rows=8, amx=True)
    x = torch.randn(9, 96, generator=gen).bfloat16()
    assert torch.equal(capped(x), torch.nn.functional.linear(x, capped.weight))
    # An 8-bit head has no other form of its codes: the AMX kernel from one row.
    head = _linear_with_codes(_random_q8_0(48, 96, seed=6), max_rows=64)
    for rows in (1, 64, 65):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        expected = (
            gguf_int4.amx_linear(x, head.int4, None)
            if rows <= 64
            else torch.nn.functional.linear(x, head.weight)
        )
        assert torch.equal(head(x), expected), rows


@needs_f32
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_float32_kernel_computes_with_exactly_the_dense_weights(fmt: str, bias: bool) -> None:
    codes = _random_codes(48, 96, seed=7) if fmt == "q4_1" else _random_q8_0(48, 96, seed=7)
    linear = _linear_with_codes(codes, max_rows=16, bias=bias, dtype=torch.float32)
    if bias:
        with torch.no_grad():
            linear.bias.copy_(torch.randn(48))
    forms = linear.int4
    assert forms.packed is None and forms.tiles is None  # float32 reads this form only
    assert torch.equal(gguf_int4.f32_weights(forms), codes.dequantize())
    gen = torch.Generator().manual_seed(8)
    # Passes of 4 rows and the 1-3 left over, up to the kernel's 16.
    for rows in (1, 2, 3, 4, 5, 7, 8, 16):
        x = torch.randn(rows, 96, generator=gen)
        y = gguf_int4.f32_linear(x, forms, linear.bias)
        exact = x.double() @ codes.dequantize().double().t()
        if bias:
            exact += linear.bias.double()
        assert y.shape == (rows, 48)
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    wide = torch.randn(8, 192, generator=gen)  # a strided x is read as its values
    assert torch.equal(
        gguf_int4.f32_linear(wide[:, ::2], forms, None),
        gguf_int4.f32_linear(wide[:, ::2].contiguous(), forms, None),
    )
    # The kernel trusts its shapes: anything it would read past is refused first.
    for bad in (torch.randn(2, 64), torch.randn(17, 96), torch.randn(2, 96).bfloat16()):
        with pytest.raises(ValueError, match="f32_linear: x"):
            gguf_int4.f32_linear(bad, forms, None)
    with pytest.raises(ValueError, match="f32_linear: bias"):
        gguf_int4.f32_linear(torch.randn(2, 96), forms, torch.zeros(47))


@needs_f32
def test_float32_steps_of_up_to_f32_max_rows_read_the_codes_and_larger_ones_the_dense_weights(
    monkeypatch,
) -> None:
    codes = _random_codes(48, 96, seed=9)
    linear = _linear_with_codes(codes, max_rows=64, dtype=torch.float32)
    dense = _linear_with_codes(codes, max_rows=0, dtype=torch.float32)
    linear.pack()
    dense.pack()
    gen = torch.Generator().manual_seed(10)
    avx512 = "avx512f" in cpu_flags().split()
    assert gguf_int4.F32_MAX_ROWS == (8 if avx512 else 16)
    cpus = [("flags : fpu sse2 avx avx2 avx512f", 8), ("flags : fpu sse2 avx avx2", 16),
            ("flags : fpu sse2 sse4_2 avx", 0), ("Features : fp asimd", 16)]  # fmt: skip
    for flags, most in cpus:  # without AVX2 the dense weights win at every size
        monkeypatch.setattr("tandem.kernels.cpu.build.cpu_flags", lambda f=flags: f)
        assert gguf_int4._f32_max_rows() == most, flags
    monkeypatch.setattr(gguf_int4, "F32_MAX_ROWS", 8)
    for rows in (0, 1, 8, 9, 16, 17):
        x = torch.randn(rows, 96, generator=gen)
        expected = gguf_int4.f32_linear(x, linear.int4, None) if 0 < rows <= 8 else dense(x)
        assert torch.equal(linear(x), expected), rows
    capped = _linear_with_codes(codes, max_rows=2, dtype=torch.float32)  # max_rows caps it
    x = torch.randn(3, 96, generator=gen)
    assert torch.equal(capped(x), torch.nn.functional.linear(x, capped.weight))
    head = _linear_with_codes(_random_q8_0(48, 96, seed=11), max_rows=64, dtype=torch.float32)
    x = torch.randn(1, 96, generator=gen)
    assert torch.equal(head(x), gguf_int4.f32_linear(x, head.int4, None))


@needs_f32
def test_a_float32_step_that_samples_nothing_runs_on_the_codes_engine() -> None:
    # A prompt longer than a step's token budget: its first chunk samples no token, so
    # the LM head gets no rows. The float32 codes' kernel refused them, and the engine
    # loop then failed every request of the worker (a prefill worker: any long prompt).
    base = dict(model="smollm2-135m-instruct", device="cpu", dtype="float32", num_blocks=16,
                max_num_batched_tokens=16)  # fmt: skip
    prompt = list(range(100, 120))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    codes = LLMEngine(EngineConfig(**base))
    assert codes.model.lm_head.int4 is not None
    dense = LLMEngine(EngineConfig(**base, int4_max_rows=0))
    assert codes.generate([prompt], params) == dense.generate([prompt], params)
    assert codes.kv.pool.num_used == 0


# An engine whose cache_dir is writable in a process whose home is not: it prints
# whether its LM head reads the codes, and the kernel libraries that loaded.
_CACHE_DIR_ONLY = """
import sys
from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.kernels.cpu import build
engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", dtype="float32", num_blocks=16,
                                cache_dir=sys.argv[1]))
print(engine.model.lm_head.int4 is not None, [str(p) for p, lib in build._loaded.items() if lib])
"""


@needs_f32
def test_every_cpu_kernel_comes_from_the_engines_cache_dir(tmp_path) -> None:
    # Only attention read cache_dir: the codes, RMSNorm and the step ops built into the
    # default cache, and where that was not writable (a read-only home, the reason to
    # set cache_dir) float32 steps silently ran without the codes.
    import os
    import subprocess
    import sys

    from tandem.engine.loader import default_cache_dir

    resolve_model("smollm2-135m-instruct")  # converted into the default cache, once
    (tmp_path / "models").symlink_to(default_cache_dir() / "models")
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_CACHE_DIR", "XDG_CACHE_HOME")}
    out = subprocess.run([sys.executable, "-c", _CACHE_DIR_ONLY, str(tmp_path)],
                         env={**env, "HOME": "/dev/null"}, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == f"True ['{tmp_path}']"


def _down_projections_with_codes(dtype: torch.dtype, amx: bool = False):
    """tiny-random with every layer's down projection set to random codes, and those
    codes packed for ``dtype``: (its config, the model, the packed forms)."""
    cfg = ModelConfig.from_hf(read_config(resolve_model("tiny-random")))
    model = LlamaModel(cfg, 64)
    packed = {}
    for i, layer in enumerate(model.layers):
        module = layer.mlp.down_proj
        codes = _random_codes(*module.weight.shape, seed=i)
        with torch.no_grad():
            module.weight.copy_(codes.dequantize())
        packed[f"layers.{i}.mlp.down_proj"] = gguf_int4.pack(codes, dtype, amx)
    return cfg, model, packed


@needs_f32
def test_float32_codes_that_do_not_expand_to_the_weights_are_dropped(caplog) -> None:
    cfg, model, packed = _down_projections_with_codes(torch.float32)
    packed["layers.0.mlp.down_proj"].f32_codes[0, 0] ^= 0x10  # one weight's code
    with caplog.at_level(logging.WARNING):
        checked = gguf_int4._without_wrong_tiles(model, packed)
    assert "layers.0.mlp.down_proj" not in checked  # float32 has no other form of them
    others = range(1, cfg.num_layers)
    assert all(checked[f"layers.{i}.mlp.down_proj"].f32_codes is not None for i in others)
    assert "1 projections' codes do not expand to their weights in the kernel" in caplog.text


def test_a_cache_file_whose_codes_a_kernel_would_misread_is_refused() -> None:
    cfg = ModelConfig.from_hf(read_config(resolve_model("tiny-random")))
    model = LlamaModel(cfg, 64)
    down = model.layers[0].mlp.down_proj
    forms = gguf_int4.pack(_random_codes(*down.weight.shape), torch.float32)
    tensors = {
        "layers.0.mlp.down_proj.f32_codes": forms.f32_codes,
        "layers.0.mlp.down_proj.f32_scales": forms.f32_scales,
    }
    assert gguf_int4._fitting(model, tensors, amx=False, f32=True).keys() == {
        "layers.0.mlp.down_proj"
    }
    # float16 scales would be read as float32: half the bytes, so past their end.
    half = dict(tensors, **{"layers.0.mlp.down_proj.f32_scales": forms.f32_scales.half()})
    with pytest.raises(ValueError, match="f32_scales is torch.float16, not contiguous"):
        gguf_int4._fitting(model, half, amx=False, f32=True)
    with pytest.raises(ValueError, match="tiles None"):  # a bfloat16 file's parts expected
        gguf_int4._fitting(model, tensors, amx=True, f32=False)


@needs_amx
def test_tiles_that_do_not_expand_to_the_weights_are_dropped(caplog) -> None:
    cfg, model, packed = _down_projections_with_codes(torch.bfloat16, amx=True)
    packed["layers.0.mlp.down_proj"].tiles[0, 0, 0, 0] ^= 0x10  # one weight's code
    with caplog.at_level(logging.WARNING):
        checked = gguf_int4._without_wrong_tiles(model, packed)
    assert checked["layers.0.mlp.down_proj"].tiles is None
    assert checked["layers.0.mlp.down_proj"].packed is not None  # torch's form stays
    others = range(1, cfg.num_layers)
    assert all(checked[f"layers.{i}.mlp.down_proj"].tiles is not None for i in others)
    assert "1 projections' codes do not expand to their weights in the kernel" in caplog.text


def test_codes_that_do_not_give_the_loaded_weights_are_not_used(caplog) -> None:
    cfg = ModelConfig.from_hf(read_config(resolve_model("tiny-random")))
    model = LlamaModel(cfg, 64)
    tensors = {}
    for i, layer in enumerate(model.layers):
        for name, module in (
            ("self_attn.o_proj", layer.self_attn.o_proj),
            ("mlp.down_proj", layer.mlp.down_proj),
        ):
            codes = _random_codes(*module.weight.shape, seed=i)
            with torch.no_grad():
                module.weight.copy_(codes.dequantize())
            tensors[f"model.layers.{i}.{name}.weight"] = codes
    bad = tensors["model.layers.1.mlp.down_proj.weight"]
    bad.codes[0, 0] ^= 1
    with caplog.at_level(logging.WARNING):
        found = gguf_int4.matching_codes(model, tensors)
    expected = {
        f"layers.{i}.{n}"
        for i in range(cfg.num_layers)
        for n in ("self_attn.o_proj", "mlp.down_proj")
    }
    assert set(found) == expected - {"layers.1.mlp.down_proj"}
    assert (
        "1 projections' 4-bit codes do not give the loaded weights (e.g. layers.1.mlp.down_proj)"
        in caplog.text
    )


@pytest.mark.slow
def test_the_default_models_codes_are_its_loaded_weights(smol) -> None:
    # Nibble order, block layout and llama.cpp's RoPE row order of q and k: every
    # projection's codes dequantise to exactly what transformers' GGUF loader gives.
    model, codes = smol
    cfg = model.cfg
    assert len(codes) == 7 * cfg.num_layers
    assert len(gguf_int4.matching_codes(model, codes)) == 4 * cfg.num_layers


@pytest.mark.slow
def test_the_default_models_head_codes_are_its_loaded_weights(smol) -> None:
    # Its LM head is its token embedding, stored as Q8_0.
    model, _ = smol
    head = gguf_int4.read_q8_0_head(smollm2_gguf_path(), model.cfg.tie_word_embeddings)
    assert head is not None
    assert torch.equal(head.dequantize(), model.lm_head.weight.detach().float())


@pytest.mark.slow
def test_int4_projections_err_about_as_much_as_bfloat16_weights(smol) -> None:
    # Against the exact weights: the int4 kernel rounds d and m + 8d to bfloat16, the
    # dense path each weight; measured 1.2x here, bounded at 1.5x.
    _, codes = smol
    gen = torch.Generator().manual_seed(0)
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.20.mlp.down_proj.weight"):
        weight = codes[name].dequantize()
        x = torch.randn(4, weight.shape[1], generator=gen).bfloat16()
        exact = x.double() @ weight.double().t()
        dense = torch.nn.functional.linear(x, weight.bfloat16())
        int4 = _linear_with_codes(codes[name], max_rows=4)(x)

        dense_error, int4_error = (
            ((y.double() - exact).norm() / exact.norm()).item() for y in (dense, int4)
        )
        assert int4_error <= 1.5 * dense_error, (name, int4_error, dense_error)


@pytest.mark.slow
def test_an_engine_uses_the_codes_of_its_dtype_and_keeps_them_for_the_next_start(
    tmp_path, monkeypatch
) -> None:
    def int4_projections(engine: LLMEngine) -> int:
        return sum(m.int4 is not None for m in engine.model.modules() if isinstance(m, Linear))

    model = "smollm2-135m-instruct"
    base = dict(model=model, device="cpu", num_blocks=16)
    assert int4_projections(LLMEngine(EngineConfig(**base, dtype="bfloat16", int4_max_rows=0))) == 0
    assert int4_projections(LLMEngine(EngineConfig(**base, dtype="float32", int4_max_rows=0))) == 0
    if gguf_int4.f32_available():  # float32: the four projections a layer and the head
        f32 = LLMEngine(EngineConfig(**base, dtype="float32"))
        assert int4_projections(f32) == 4 * f32.model_config.num_layers + 1
        codes = [getattr(m, "int4", None) for m in f32.model.modules()]
        assert all(c.f32_codes is not None for c in codes if c is not None)
    # A model directory of its own, so that the first start builds the cache file.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in resolve_model(model).iterdir():
        if not f.name.startswith("int4-"):
            (model_dir / f.name).symlink_to(f)
    monkeypatch.setattr("tandem.engine.engine.resolve_model", lambda *a, **k: model_dir)
    engine = LLMEngine(EngineConfig(**base, dtype="bfloat16"))
    # Four projections a layer, and with AMX the 8-bit LM head.
    expected = 4 * engine.model_config.num_layers + gguf_int4.amx_available()
    assert int4_projections(engine) == expected
    (cached,) = model_dir.glob("int4-bfloat16-*")  # one file, and no partial one left
    assert cached.name.startswith("int4-bfloat16-") and cached.suffix == ".safetensors"

    def no_gguf(*args):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_int4, "read_q4_1", no_gguf)
    again = LLMEngine(EngineConfig(**base, dtype="bfloat16"))
    first = engine.model.layers[0].mlp.down_proj.int4
    assert (first.tiles is not None) == gguf_int4.amx_available()
    assert all(
        a is b is None or torch.equal(a, b)
        for a, b in zip(again.model.layers[0].mlp.down_proj.int4, first, strict=True)
    )
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(max_tokens=8, temperature=0)
    assert engine.generate([prompt], params) == again.generate([prompt], params)


@pytest.mark.slow
@pytest.mark.parametrize("batched", [False, True], ids=["one-row-steps", "six-row-steps"])
def test_a_decode_step_from_the_codes_is_as_close_to_float32_as_bfloat16s(
    smol_engine, batched: bool
) -> None:
    # The first decode step (after a dense prefill) against the float32 engine: its
    # top-20 logprobs stray from float32's about as far as the dense bfloat16
    # engine's do (measured 0.09-0.34 nats for both); codes read wrong would stray by
    # whole nats. One request at a time, each decode step is one row (torch's int4
    # kernel); six at once, six rows (the AMX kernel where this CPU has one).
    base = dict(model="smollm2-135m-instruct", device="cpu", dtype="bfloat16", num_blocks=64)
    int4, dense = (LLMEngine(EngineConfig(**base, int4_max_rows=m)) for m in (64, 0))
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=20)
    prompts = [
        "Name a colour.",
        "What is the capital of France?",
        "Count to five.",
        "Why is the sky blue?",
        "Say hello in Spanish.",
        "Write a haiku about autumn.",
    ]
    ids = [smol_engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in prompts]
    steps: dict[str, dict[str, list]] = {}
    for name, engine in (("fp32", smol_engine), ("int4", int4), ("dense", dense)):
        by_request: dict[str, list] = {}
        for group in [ids] if batched else [[one] for one in ids]:
            for prompt in group:
                by_request[engine.add_request(prompt, params)] = []
            for out in _drain(engine):
                by_request[out.request_id].extend(out.logprobs)
        steps[name] = list(by_request.values())
    worst = {"int4": 0.0, "dense": 0.0}
    compared = 0
    for i in range(len(prompts)):
        if len({steps[name][i][0].token_id for name in steps}) > 1:
            continue  # a different first token: the decode steps see different contexts
        compared += 1
        ref = dict(steps["fp32"][i][1].top)
        for name in worst:
            top = dict(steps[name][i][1].top)
            worst[name] = max(worst[name], *(abs(top[t] - ref[t]) for t in set(top) & set(ref)))
    assert compared >= 4
    assert worst["int4"] <= 1.5 * worst["dense"] + 0.05, worst


def _drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


@pytest.mark.slow
def test_a_cache_file_that_does_not_fit_is_rebuilt_and_one_that_cannot_be_kept_is_not_needed(
    smol, tmp_path, monkeypatch, caplog
) -> None:
    model, codes = smol
    gguf = smollm2_gguf_path()
    # Layer 0's codes only: each build below then takes little time.
    first = {name: c for name, c in codes.items() if name.startswith("model.layers.0.")}
    monkeypatch.setattr(gguf_int4, "read_q4_1", lambda *args: first)
    built = gguf_int4.load_packed(model, gguf, tmp_path, torch.bfloat16)
    assert len(built) == 4 + gguf_int4.amx_available()  # the layer, and the 8-bit head
    (cached,) = tmp_path.glob("int4-*")
    cached.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING):
        rebuilt = gguf_int4.load_packed(model, gguf, tmp_path, torch.bfloat16)
    assert f"rebuilding {cached}, which does not fit the model" in caplog.text
    assert rebuilt.keys() == built.keys()
    # A build killed beside one that completed left its partial file, and only a build
    # looked for it: a start that finds the cache file removes it (a live one's stays).
    from tandem.engine import loader

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    dead = cached.with_name(f"{cached.name}.{loader._owner()}.{ended}.partial")
    live = cached.with_name(f"{loader.owned_name(cached.name)}.partial")
    for partial in (dead, live):
        partial.write_bytes(b"half the codes")
    assert gguf_int4.load_packed(model, gguf, tmp_path, torch.bfloat16).keys() == built.keys()
    assert not dead.exists() and live.exists()
    live.unlink()
    # A file whose bytes changed after it was written (a bit flipped on disk) is
    # rebuilt too: the torch-packed form has no other check, and decoded wrong tokens.
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(cached), framework="pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    name = next(n for n in sorted(tensors) if n.startswith("layers.0.mlp.down_proj."))
    tensors[name].view(torch.uint8).view(-1)[0] ^= 0x10
    save_file(tensors, str(cached), metadata=metadata)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = gguf_int4.load_packed(model, gguf, tmp_path, torch.bfloat16)
    assert f"rebuilding {cached}" in caplog.text and "not those it was written with" in caplog.text
    for n, forms in again.items():
        for part, t in forms._asdict().items():
            assert t is None or torch.equal(t, getattr(built[n], part)), (n, part)

    def full(*args):
        raise RuntimeError("No space left on device")  # safetensors' own error is no OSError

    cached.unlink()
    monkeypatch.setattr("safetensors.torch.save_file", full)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert gguf_int4.load_packed(model, gguf, tmp_path, torch.bfloat16).keys() == built.keys()
    assert "cannot keep the packed 4-bit codes" in caplog.text
    assert not list(tmp_path.iterdir())  # no partial file left
