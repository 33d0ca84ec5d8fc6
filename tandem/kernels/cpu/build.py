"""Compile the CPU kernels with the system's C compiler, once per machine, and load them.

The library is built for this CPU (``-march=native``) into the cache directory
(``default_cache_dir()/kernels``), under a name that hashes everything the binary
depends on: the sources, the compiler and its version, the flags and the CPU's
feature flags, so a cache shared between different machines never hands one a
binary built for another. A build takes about a second; later loads find the file.
Concurrent builders (several workers starting at once) each write a private file
and rename it into place, so a reader never sees half a library.

No compiler, or a failed build, is not an error here: ``load`` returns None and
logs why once, and ``attention_backend: auto`` falls back to the torch backend.
``CC`` chooses the compiler (default ``cc``), as it does for other builds.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

# Compiled together into one library: the decode attention, the projections from a
# GGUF's codes, RMSNorm, and the small steps (RoPE, the KV store, the greedy argmax).
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("paged_decode.c", "gguf_linear.c", "codes_f32.c", "rms_norm.c", "step_ops.c")
)
# Included by the sources: part of what a build depends on.
HEADERS = (Path(__file__).with_name("bf16.h"),)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-Wall")
_BUILD_TIMEOUT_S = 120

_loaded: dict[Path, ctypes.CDLL | None] = {}
_functions: dict[str, Callable[..., int] | None] = {}
# The first library loaded (from an engine's cache_dir, or the default cache): the
# one ``function`` serves, so that every kernel of a process comes from one build. Once
# tried, a first load that failed stands: no kernel of the process is then compiled
# elsewhere (into the home directory, behind a read-only cache_dir).
_first: ctypes.CDLL | None = None
_tried = False
# A caller during the first load (or build) waits for it; re-entered by ``function``.
_loading = threading.RLock()


class BuildError(RuntimeError):
    pass


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def compiler() -> list[str]:
    """The C compiler's command: ``CC`` split as a shell would ("ccache gcc", "cc -pipe")."""
    try:
        return shlex.split(os.environ.get("CC", "")) or ["cc"]
    except ValueError as exc:  # an unbalanced quote
        raise BuildError(f"CC={os.environ['CC']!r} is not a command: {exc}") from None


def library_path(cache_dir: Path, compiler: Sequence[str]) -> Path:
    """Where the library built by ``compiler`` (a command) for this CPU lives."""
    version = subprocess.run(
        [*compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    key = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        key.update(source.read_bytes())
    for part in (version, " ".join(compiler), " ".join(FLAGS)):
        key.update(part.encode())
    key.update(cpu_flags().encode())
    return cache_dir / "kernels" / f"cpu-kernels-{key.hexdigest()[:16]}.so"


def build(cache_dir: Path, compiler: Sequence[str]) -> Path:
    """The library's path, compiling it first if it is not in the cache."""
    path = library_path(cache_dir, compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    log.info("compiling the CPU attention kernels with %s into %s", " ".join(compiler), path)
    try:
        done = subprocess.run(
            [*compiler, *FLAGS, "-o", str(partial), *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-5:]
            raise BuildError(f"{compiler[0]} exited with {done.returncode}: " + " / ".join(tail))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def load(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) where they cannot be built here."""
    import torch  # noqa: F401  (torch's libgomp must be loaded first: the library shares it)

    from tandem.engine.loader import default_cache_dir

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    with _loading:
        if cache in _loaded:
            return _loaded[cache]
        lib = None
        try:
            command = compiler()
            if shutil.which(command[0]) is None:
                raise BuildError(f"no C compiler {command[0]!r} on PATH (set CC to choose one)")
            lib = _open(cache, command)
        except (BuildError, OSError, subprocess.SubprocessError) as exc:
            log.warning(
                "CPU kernels unavailable in %s, using torch's ops instead (attention, "
                "RMSNorm, the GGUF's codes): %s",
                cache,
                exc,
            )
        _loaded[cache] = lib
        global _first, _tried
        if not _tried:
            _first, _tried = lib, True
        return lib


def _open(cache: Path, command: Sequence[str]) -> ctypes.CDLL:
    """The library in ``cache``, built if it is not there; one that is there and does
    not load (cut short, copied in half by a cache sync) is built again, once."""
    path = library_path(cache, command)
    if not path.exists():
        return ctypes.CDLL(str(build(cache, command)))
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("the CPU kernels in %s do not load (%s): compiling them again", path, exc)
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(build(cache, command)))


def function(symbol: str, argtypes: list) -> Callable[..., int] | None:
    """``symbol`` of the first library loaded (``load``: an engine loads its
    cache_dir's first; else the default cache's), returning a C int, its arguments
    ``argtypes``; None where the library cannot be built here. Looked up once."""
    if symbol in _functions:
        return _functions[symbol]
    with _loading:
        if symbol not in _functions:
            lib = _first if _tried else load()
            fn = None
            if lib is not None:
                fn = getattr(lib, symbol)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            _functions[symbol] = fn
    return _functions[symbol]
