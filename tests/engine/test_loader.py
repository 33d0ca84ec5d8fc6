"""Model sources (built-in names, GGUF files, HF directories) and EngineConfig validation."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.config import EngineConfig
from tandem.engine import loader, tiny_random
from tandem.engine.engine import model_source
from tandem.engine.loader import resolve_model
from tandem.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny_dir(tiny_cache) -> Path:
    return resolve_model("tiny-random", tiny_cache)


# ---- tiny-random ------------------------------------------------------------------------


def test_tiny_random_is_built_once_per_cache(tiny_cache, tiny_dir, monkeypatch):
    weights = tiny_dir / "model.safetensors"
    before = weights.stat()

    def no_rebuild(out):
        raise AssertionError(f"tiny-random rebuilt into {out}")

    monkeypatch.setattr(tiny_random, "write_tiny_random", no_rebuild)
    assert resolve_model("tiny-random", tiny_cache) == tiny_dir
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # The build left nothing behind but the model itself.
    assert list((tiny_cache / "models").iterdir()) == [tiny_dir]


def test_tiny_random_weights_are_deterministic(tiny_dir, tmp_path):
    other = resolve_model("tiny-random", tmp_path)
    assert other != tiny_dir
    ours = load_file(str(tiny_dir / "model.safetensors"))
    theirs = load_file(str(other / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name]), name
    assert (tiny_dir / "config.json").read_text() == (other / "config.json").read_text()
    for f in TOKENIZER_FILES:
        assert (tiny_dir / f).read_text() == (other / f).read_text(), f


def test_tiny_random_loads_in_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    hf, info = AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, output_loading_info=True
    )
    assert {k: sorted(v) for k, v in info.items() if k != "error_msgs"} == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
    }
    assert info["error_msgs"] == []
    assert hf.config.vocab_size == len(tok) == 256 + len(tiny_random.SPECIAL_TOKENS)
    assert hf.config.num_hidden_layers == tiny_random.LAYERS
    stored = load_file(str(tiny_dir / "model.safetensors"))
    loaded = hf.state_dict()
    assert sorted(loaded) == sorted(stored)
    for name, tensor in stored.items():
        assert torch.equal(loaded[name], tensor), name
    # Byte-level, no merges: one token per byte, and a lossless round trip.
    text = "héllo"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


# ---- directories and files --------------------------------------------------------------


def test_hf_directory_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), tmp_path / "cache") == tmp_path
    assert not (tmp_path / "cache").exists()


def test_directory_without_config_json_is_refused_by_name(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        resolve_model(str(tmp_path), tmp_path / "cache")
    assert str(err.value) == (
        f"model {str(tmp_path)!r} is neither a .gguf file nor a directory with config.json"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "cannot read {path}: Expecting property name enclosed in double quotes"),
        ("[]", "{path} is not a JSON object, got list"),
        ('{"model_type": "llama"}', "{path} has no vocab_size"),
    ],
    ids=["corrupt", "not-an-object", "no-sizes"],
)
def test_a_damaged_config_json_is_refused_naming_the_file(tmp_path, text, message):
    """It was a JSONDecodeError, AttributeError or KeyError traceback at start-up."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as err:
        model_source(EngineConfig(model=str(tmp_path), cache_dir=str(tmp_path / "cache")))
    assert str(err.value).startswith(message.format(path=tmp_path / "config.json"))


def test_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError) as err:
        resolve_model(str(weights), tmp_path / "cache")
    assert str(err.value) == (
        f"model {str(weights)!r} is neither a .gguf file nor a directory with config.json"
    )


def test_unknown_name_lists_the_builtin_models(tmp_path):
    with pytest.raises(ConfigError) as err:
        resolve_model("smollm2", tmp_path)
    assert str(err.value) == (
        "unknown model 'smollm2': expected one of smollm2-135m-instruct, tiny-random, "
        "a Hugging Face directory or a .gguf file"
    )


def test_corrupt_gguf_is_refused_and_leaves_no_partial_model(tmp_path):
    junk = tmp_path / "x.gguf"
    junk.write_bytes(bytes(range(256)) * 16)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as err:
        resolve_model(str(junk), cache)
    assert str(err.value).startswith(f"cannot read the GGUF metadata of {junk}: ")
    # Refused from its metadata: no model (whole or half) was started.
    assert not (cache / "models").exists()


def test_a_start_removes_what_an_interrupted_one_left(tmp_path):
    # A worker stopped by a signal while it dequantised the model (tens of seconds on a
    # first start) left its temporary copy, up to the model's size, for good.
    models = tmp_path / "cache" / "models"
    name = f"tiny-random-v{loader._CACHE_VERSION}"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    pid = ended.stdout.strip()
    dead = models / f"{name}.{loader._owner()}.{pid}.abcd1234"
    dead.mkdir(parents=True)
    (dead / "config.json").write_text("{}")  # half written
    live = models / f"{loader.owned_name(name)}.efgh5678"  # this process: still at work
    live.mkdir()
    # Another host's, or another PID namespace's (a container sharing the host name and
    # the cache): its pid means nothing here.
    host, namespace = loader._owner().rsplit(".", 1)
    others = [models / f"{name}.another-host.{namespace}.{pid}.ijkl9012",
              models / f"{name}.{host}.{int(namespace) + 1}.{pid}.mnop3456"]  # fmt: skip
    for other in others:
        other.mkdir()
    assert resolve_model("tiny-random", tmp_path / "cache") == models / name
    assert not dead.exists() and live.exists() and all(o.exists() for o in others)


def test_a_start_that_finds_the_model_built_removes_what_a_killed_build_left(tmp_path):
    # Two starts built at once and one was killed: the other's copy was found from
    # then on, and the killed one's (up to the model's size) was never looked for again.
    built = resolve_model("tiny-random", tmp_path / "cache")
    dead = built.with_name(f"{built.name}.{loader._owner()}.{_ended_pid()}.abcd1234")
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half a model")
    live = built.with_name(f"{loader.owned_name(built.name)}.efgh5678")  # at work still
    live.mkdir()
    assert resolve_model("tiny-random", tmp_path / "cache") == built
    assert not dead.exists() and live.exists()


def _ended_pid() -> str:
    """The pid of a process that has ended."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    return ended.stdout.strip()


def test_whether_a_model_needs_building_is_read_without_building_it(tmp_path):
    cache = tmp_path / "cache"
    assert loader.needs_building("tiny-random", cache)
    assert not (cache / "models").exists()  # nothing built to answer
    resolve_model("tiny-random", cache)
    assert not loader.needs_building("tiny-random", cache)
    # A model that cannot resolve is for its loading to report.
    assert not loader.needs_building("/nonexistent/m.gguf", cache)
    assert not loader.needs_building(str(tmp_path), cache)


def test_a_cache_directory_that_cannot_be_made_is_named(tmp_path):
    # A worker ended with a traceback (a HOME that is a file, a read-only disk).
    not_a_dir = tmp_path / "home"
    not_a_dir.write_text("")
    with pytest.raises(ConfigError, match=r"cannot use the cache directory .*home/cache/models"):
        resolve_model("tiny-random", not_a_dir / "cache")


def test_a_gguf_of_a_model_tandem_cannot_run_is_refused_before_it_is_dequantised(
    tmp_path, monkeypatch
):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(loader, "_gguf_config", lambda path: {"model_type": "stablelm"})
    built = []
    monkeypatch.setattr(loader, "_atomic_dir", lambda target, build: built.append(target))
    with pytest.raises(ConfigError, match="model_type 'stablelm' is not supported"):
        resolve_model(str(gguf), tmp_path / "cache")
    assert built == []


def _gguf_with(path: Path, scaling: dict, freqs: bool = False) -> Path:
    """A GGUF holding only RoPE metadata (and rope_freqs.weight if ``freqs``)."""
    import numpy as np
    from gguf import GGUFWriter, RopeScalingType

    writer = GGUFWriter(str(path), "llama")
    for key, value in scaling.items():
        value = RopeScalingType(value) if key == "type" else value
        getattr(writer, f"add_rope_scaling_{key}")(value)
    if freqs:
        writer.add_tensor("rope_freqs.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_ggufs_rope_scaling_reaches_the_config(tmp_path):
    # transformers' GGUF loader drops it for Llama: plain RoPE past the trained
    # positions, wrong tokens and no error.
    linear = _gguf_with(tmp_path / "l.gguf", {"type": "linear", "factor": 4.0})
    assert loader.gguf_rope_scaling(linear) == {"rope_type": "linear", "factor": 4.0}
    config = loader.with_rope_scaling({"rope_theta": 1e5}, loader.gguf_rope_scaling(linear))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    v5 = loader.with_rope_scaling({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}},
                                  {"rope_type": "linear", "factor": 4.0})  # fmt: skip
    assert v5["rope_parameters"] == {"rope_theta": 1e5, "rope_type": "linear", "factor": 4.0}
    yarn = _gguf_with(tmp_path / "y.gguf", {"type": "yarn", "factor": 4.0,
                                            "orig_ctx_len": 8192})  # fmt: skip
    assert loader.gguf_rope_scaling(yarn) == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert loader.gguf_rope_scaling(_gguf_with(tmp_path / "n.gguf", {})) == {}
    with pytest.raises(ConfigError, match="rope_freqs.weight"):
        loader.gguf_rope_scaling(_gguf_with(tmp_path / "f.gguf", {}, freqs=True))


def test_entries_no_start_can_find_are_removed_when_a_model_is_built_again(tmp_path):
    # Each reinstall of a model's package (a new path or mtime) kept a full copy.
    models = tmp_path / "models"
    ggufs = {name: tmp_path / f"{name}.gguf" for name in ("kept", "touched", "gone", "other")}
    entries = {}
    for i, (name, gguf) in enumerate(ggufs.items()):
        gguf.write_bytes(b"GGUF")
        entries[name] = models / f"m-{i:016x}"
        entries[name].mkdir(parents=True)
        (entries[name] / loader._SOURCE).write_text(json.dumps(loader._source(gguf)))
    ggufs["gone"].unlink()
    os.utime(ggufs["touched"], ns=(1, 1))
    # Another cache version's entry of an unchanged GGUF: that version's starts find it.
    other_version = {**loader._source(ggufs["other"]), "version": "99"}
    (entries["other"] / loader._SOURCE).write_text(json.dumps(other_version))
    old = models / f"m-{9:016x}"  # records no source: nothing to judge by
    old.mkdir()
    garbled = models / f"m-{10:016x}"
    garbled.mkdir()
    (garbled / loader._SOURCE).write_text("{")
    another_model = models / f"other-{8:016x}"
    another_model.mkdir()
    built = models / f"m-{7:016x}"
    built.mkdir()
    loader._remove_unreachable(built)
    assert sorted(p.name for p in models.iterdir()) == sorted(
        e.name for e in (entries["kept"], entries["other"], old, garbled, another_model, built)
    )


def test_a_cache_entry_without_its_config_is_replaced(tmp_path):
    # A copy cut short, or made by hand: the rename over it failed at every start.
    entry = tmp_path / "cache" / "models" / f"tiny-random-v{loader._CACHE_VERSION}"
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_text("x")
    assert resolve_model("tiny-random", tmp_path / "cache") == entry
    assert loader.load_state_dict(entry)  # the real weights
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


def _complete(out: Path) -> None:
    (out / "model.safetensors").write_text("weights")
    (out / "config.json").write_text("{}")


def test_starts_that_replace_an_incomplete_entry_together_both_get_the_model(tmp_path, monkeypatch):
    # Start B puts its copy in place while start A removes the incomplete one it put
    # aside: A's rename then failed, and A ended with a ConfigError about free space.
    target = tmp_path / "models" / "m-0123456789abcdef"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_text("cut short")
    theirs = tmp_path / "models" / "theirs"
    theirs.mkdir()
    _complete(theirs)
    rmtree = shutil.rmtree

    def b_lands_meanwhile(path, *args, **kw):
        rmtree(path, *args, **kw)
        if ".incomplete" in str(path) and theirs.exists():
            theirs.rename(target)

    monkeypatch.setattr(loader.shutil, "rmtree", b_lands_meanwhile)
    assert loader._atomic_dir(target, _complete) == target
    assert (target / "config.json").is_file()
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_a_complete_entry_put_aside_by_another_start_is_put_back(tmp_path, monkeypatch):
    # Start B saw no config, then A completed the entry, then B moved A's (in use) aside.
    target = tmp_path / "models" / "m-0123456789abcdef"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_text("cut short")
    rename = Path.rename

    def a_completes_first(self, to):
        if str(to).endswith(".incomplete0") and not (self / "config.json").exists():
            shutil.rmtree(self)
            self.mkdir()
            _complete(self)  # A's copy, complete, where B is about to move it from
            (self / "from-a").write_text("")
        return rename(self, to)

    monkeypatch.setattr(Path, "rename", a_completes_first)
    built = []
    assert loader._atomic_dir(target, lambda out: built.append(_complete(out))) == target
    assert (target / "from-a").is_file() and built  # A's copy, which A may be loading
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_weights_cut_short_are_named_with_the_way_to_rebuild(tmp_path):
    entry = resolve_model("tiny-random", tmp_path / "cache")
    weights = entry / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ConfigError, match=f"cannot read the weights in {weights}: .*built again"):
        loader.load_state_dict(entry)


def test_a_cache_directory_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    def read_only(**kw):
        raise OSError(errno.EROFS, "Read-only file system", kw["dir"])

    monkeypatch.setattr(loader.tempfile, "mkdtemp", read_only)
    with pytest.raises(ConfigError, match=r"cannot build tiny-random-v\d+ in the cache "
                       r"directory .*/cache/models: .*Read-only file system"):  # fmt: skip
        resolve_model("tiny-random", tmp_path / "cache")


def test_a_model_directory_without_a_tokenizer_is_named(tmp_path):
    from tandem.engine.tokenizer import Tokenizer

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=f"cannot load the tokenizer of {tmp_path}"):
        Tokenizer.from_pretrained(tmp_path)


@pytest.mark.slow
def test_default_model_is_a_dequantised_hf_directory():
    model_dir = resolve_model("smollm2-135m-instruct")
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert (model_dir / "model.safetensors").stat().st_size > 0
    for f in TOKENIZER_FILES:
        assert (model_dir / f).is_file(), f


@pytest.mark.parametrize("xdg", ["", "relative/cache"])
def test_an_empty_or_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path, xdg):
    # As the XDG spec says: an empty one put the cache in ./tandem, wherever the command ran.
    from tandem.engine.loader import default_cache_dir

    monkeypatch.delenv("TANDEM_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert default_cache_dir() == tmp_path / ".cache" / "tandem"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "tandem"
