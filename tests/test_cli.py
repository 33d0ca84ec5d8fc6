"""``tandem generate`` run as a real process: stdout, stderr and exit codes.

Each run pays ~1.5 s of interpreter and torch start-up, so every command this
module needs is started once, a few at a time, by the ``runs`` fixture; the tests
then read their run's result by name.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tandem.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.kernels.cpu import build

GEN = ["generate", "--colocated", "--model", "tiny-random"]
KNOWN_SETTINGS = ", ".join(sorted(f.name for f in dataclasses.fields(EngineConfig)))
MODEL_LINE = "tandem: model tiny-random: "  # the engine's start-up log line
TIMING_LINE = re.compile(
    r"tandem: (\d+) prompt \+ (\d+) output tokens, finish=(\w+), TTFT \d+ ms, "
    r"\d+\.\d tok/s decode"
)


@dataclasses.dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tandem-cache")


@pytest.fixture(scope="module")
def engine(cache_dir) -> LLMEngine:
    # Built before any subprocess starts, so tiny-random and the CPU kernels are written
    # to the cache once (a process that builds them says so on stderr).
    build.load(cache_dir)
    return LLMEngine(EngineConfig(model="tiny-random", cache_dir=str(cache_dir)))


@pytest.fixture(scope="module")
def config_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("configs")
    files = {
        "unknown_key": d / "unknown_key.yaml",
        "bad_value": d / "bad_value.yaml",
        "quoted_number": d / "quoted_number.yaml",
        "not_a_mapping": d / "not_a_mapping.yaml",
        "empty_engine": d / "empty_engine.yaml",
    }
    files["unknown_key"].write_text("engine:\n  block_size: 16\n  bogus_setting: 1\n")
    files["bad_value"].write_text("engine:\n  block_size: 3\n")
    files["quoted_number"].write_text('engine:\n  block_size: "16"\n')
    files["not_a_mapping"].write_text("engine: smollm\n")
    files["empty_engine"].write_text("engine:\n")  # null: the defaults
    return files


def _commands(config_files: dict[str, Path], missing: Path) -> dict[str, list[str]]:
    gen8 = [*GEN, "--raw", "--max-tokens", "8", "--ignore-eos"]
    sample = [*GEN, "--raw", "--max-tokens", "16", "--ignore-eos", "--temperature", "1"]
    return {
        "raw": [*gen8, "hello"],
        "chat": [*GEN, "--max-tokens", "8", "--ignore-eos", "hello"],
        "seed5": [*sample, "--seed", "5", "hello"],
        "seed5_again": [*sample, "--seed", "5", "hello"],
        "seed6": [*sample, "--seed", "6", "hello"],
        "unknown_model": ["generate", "--colocated", "--model", "nope", "hi"],
        "missing_path": ["generate", "--colocated", "--model", str(missing), "hi"],
        "empty_prompt": [*GEN, ""],
        "max_tokens_0": [*GEN, "--max-tokens", "0", "hi"],
        "temperature_neg": [*GEN, "--temperature", "-1", "hi"],
        "top_p_0": [*GEN, "--top-p", "0", "hi"],
        "top_p_1.5": [*GEN, "--top-p", "1.5", "hi"],
        "top_k_neg": [*GEN, "--top-k", "-1", "hi"],
        "attention_backend": [*GEN, "--attention-backend", "cuda", "hi"],
        "over_context": [*GEN, "--raw", "--max-tokens", "5000", "hi"],
        "yaml_unknown_key": [*GEN, "--config", str(config_files["unknown_key"]), "hi"],
        "yaml_bad_value": [*GEN, "--config", str(config_files["bad_value"]), "hi"],
        "yaml_quoted_number": [*GEN, "--config", str(config_files["quoted_number"]), "hi"],
        "yaml_engine_not_a_mapping": [*GEN, "--config", str(config_files["not_a_mapping"]), "hi"],
        "yaml_empty_engine": [*gen8, "--config", str(config_files["empty_engine"]), "hello"],
        "not_an_int": [*GEN, "--max-tokens", "x", "hi"],
        "no_colocated": ["generate", "--model", "tiny-random", "hi"],
    }


def _run(argv: list[str], env: dict[str, str]) -> Run:
    p = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *argv],
        env=env,
        capture_output=True,
        timeout=120,
    )
    # Decoded here, not by the child's locale: tiny-random emits U+FFFD for split bytes.
    return Run(p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8"))


@pytest.fixture(scope="module")
def missing_model(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("nothing") / "no-such-model"


@pytest.fixture(scope="module")
def runs(engine, cache_dir, config_files, missing_model) -> dict[str, Run]:
    env = {**os.environ, "TANDEM_CACHE_DIR": str(cache_dir), "PYTHONIOENCODING": "utf-8"}
    commands = _commands(config_files, missing_model)
    workers = max(2, min(8, 2 * (os.cpu_count() or 1)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(_run, argv, env) for name, argv in commands.items()}
    return {name: f.result() for name, f in futures.items()}


def _expected_text(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return "".join(out.text for out in engine.stream(prompt_ids, params))


def _assert_generated(run: Run, expected_text: str, num_prompt_tokens: int) -> None:
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected_text + "\n"
    model_line, timing_line = run.stderr_lines
    assert model_line.startswith(MODEL_LINE)
    timing = TIMING_LINE.fullmatch(timing_line)
    assert timing is not None, timing_line
    assert timing.groups() == (str(num_prompt_tokens), "8", "length")


def test_raw_generate_prints_only_the_generated_text(runs, engine):
    prompt_ids = engine.tokenizer.encode("hello")
    expected = _expected_text(engine, prompt_ids, 8)
    assert expected  # so that two empty strings cannot pass for a match
    _assert_generated(runs["raw"], expected, len(prompt_ids))


def test_an_empty_engine_section_holds_the_defaults(runs, engine):
    prompt_ids = engine.tokenizer.encode("hello")
    _assert_generated(runs["yaml_empty_engine"], _expected_text(engine, prompt_ids, 8),
                      len(prompt_ids))  # fmt: skip


def test_chat_generate_applies_the_template(runs, engine):
    prompt_ids = engine.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert len(prompt_ids) > len(engine.tokenizer.encode("hello"))
    _assert_generated(runs["chat"], _expected_text(engine, prompt_ids, 8), len(prompt_ids))


def test_same_seed_same_text_other_seed_other_text(runs):
    first, again, other = runs["seed5"], runs["seed5_again"], runs["seed6"]
    for run in (first, again, other):
        assert run.returncode == 0, run.stderr
    assert first.stdout == again.stdout
    assert first.stdout != other.stdout


def _error(message: str) -> str:
    return f"tandem: error: {message}"


# name -> the whole error line. Each of these fails before the model loads, so the
# engine's start-up line must not appear: stderr is this one line and nothing else.
EARLY_ERRORS = {
    "empty_prompt": "prompt must not be empty",
    "max_tokens_0": "max_tokens must be >= 1, got 0",
    "temperature_neg": "temperature must be finite and >= 0, got -1.0",
    "top_p_0": "top_p must be in (0, 1], got 0.0",
    "top_p_1.5": "top_p must be in (0, 1], got 1.5",
    "top_k_neg": "top_k must be >= 0 (0 disables it), got -1",
    "attention_backend": "attention_backend must be one of auto, torch, cpu, triton, got 'cuda'",
    "unknown_model": "unknown model 'nope': expected one of smollm2-135m-instruct, tiny-random, "
    "a Hugging Face directory or a .gguf file",
    "yaml_bad_value": "block_size must be a power of two >= 1, got 3 (in {bad_value})",
    "yaml_quoted_number": "block_size must be a whole number, got '16' (str) (in {quoted_number})",
    "yaml_engine_not_a_mapping": "engine must be a mapping of settings, got 'smollm' (str) "
    "(in {not_a_mapping})",
    "no_colocated": "generate needs exactly one of --colocated (prefill and decode in this "
    "process) or --router HOST:PORT",
}


@pytest.mark.parametrize("name", sorted(EARLY_ERRORS))
def test_bad_input_fails_with_one_error_line(runs, config_files, name):
    run = runs[name]
    assert run.returncode == 2
    assert run.stdout == ""
    message = EARLY_ERRORS[name]
    for file in config_files:
        message = message.replace(f"{{{file}}}", str(config_files[file]))
    assert run.stderr == _error(message) + "\n"


def test_missing_model_path_is_named(runs, missing_model):
    run = runs["missing_path"]
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr == (_error(f"model path {str(missing_model)!r} does not exist") + "\n")


def test_unknown_yaml_key_is_listed_with_the_file(runs, config_files):
    run = runs["yaml_unknown_key"]
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr == (
        _error(
            f"unknown setting bogus_setting in {config_files['unknown_key']} "
            f"(known: {KNOWN_SETTINGS})"
        )
        + "\n"
    )


def test_prompt_plus_max_tokens_over_the_context_is_refused(runs):
    # Checked once the model (and so its context length) is known: after the start-up line.
    run = runs["over_context"]
    assert run.returncode == 2
    assert run.stdout == ""
    model_line, error_line = run.stderr_lines
    assert model_line.startswith(MODEL_LINE)
    assert error_line == _error(
        "prompt (2 tokens) + max_tokens (5000) = 5002 exceeds the context length 4096"
    )


def test_argparse_usage_errors_exit_2(runs):
    run = runs["not_an_int"]
    assert run.returncode == 2
    assert run.stdout == ""
    assert "Traceback" not in run.stderr
    assert run.stderr_lines[0].startswith("usage: tandem generate ")
    assert run.stderr_lines[-1] == (
        "tandem generate: error: argument --max-tokens: invalid int value: 'x'"
    )


def test_the_command_line_starts_without_torch():
    # Every command's flags, and the errors in them, come before any heavy import: a
    # mistyped flag answers in a tenth of a second, not after torch's second or more.
    code = (
        "import sys, tandem.cli\n"
        "tandem.cli.build_parser()\n"
        "assert tandem.cli.main(['generate', '--colocated', '--top-p', '0', 'hi']) == 2\n"
        "print(sorted(m for m in ('torch', 'transformers', 'ucxx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_httpx_does_not_log_every_request_of_an_http_load_run():
    # At INFO it wrote a line per call: 249 for an 8-request run, burying its errors.
    import logging

    from tandem.cli import main

    assert main(["plan", "--model", "tiny-random"]) == 0
    assert logging.getLogger("httpx").level == logging.WARNING  # whatever the root says


def test_the_temperature_help_names_the_least_that_samples(capsys):
    # It said "> 0 samples", and --temperature 1e-6 was then refused.
    from tandem.cli import main
    from tandem.engine.sampling_params import MIN_TEMPERATURE

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "from 1e-5 up samples" in " ".join(capsys.readouterr().out.split())
    assert MIN_TEMPERATURE == 1e-5


def test_a_router_port_grpc_would_wrap_is_refused(capsys):
    # gRPC dialled 99999 mod 65536 = 34463: another router, if one listened there.
    from tandem.cli import main

    assert main(["generate", "--router", "127.0.0.1:99999", "hi"]) == 2
    assert (
        capsys.readouterr().err
        == _error(
            "--router '127.0.0.1:99999': the port must be a number in [1, 65535], got '99999'"
        )
        + "\n"
    )


def test_a_config_section_no_tandem_config_has_is_refused(tmp_path, capsys):
    # Only engine: is read: "enigne:" ran the default model without a word.
    from tandem.cli import build_parser, engine_config, main

    typo = tmp_path / "typo.yaml"
    typo.write_text("enigne:\n  model: tiny-random\n")
    assert main(["generate", "--colocated", "--config", str(typo), "hi"]) == 2
    assert (
        capsys.readouterr().err
        == _error(
            f"unknown section enigne in {typo}: no serve, Ray, worker or router config has it "
            "(generate reads the engine: section)"
        )
        + "\n"
    )
    # A serve, Ray deploy or worker file is read for its engine: section, as before.
    for text in ("num_prefill: 1\nrouter: {port: 0}\n", "ray: {namespace: t}\n",
                 "kv_port: 0\nport: 0\n"):  # fmt: skip
        path = tmp_path / "ok.yaml"
        path.write_text(f"engine: {{model: tiny-random}}\n{text}")
        args = build_parser().parse_args(["generate", "--colocated", "--config", str(path), "x"])
        assert engine_config(args).model == "tiny-random"
