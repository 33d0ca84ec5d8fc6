"""A local Ray head for ``tandem ray up`` without ``--address``, and the state file.

The head is ``ray start --head --block`` in its own session, so it outlives the
CLI; ``--block`` makes that process own the head's daemons: on SIGTERM it stops
them all (and Ray ties them to it). Its ports are picked free at start and its
files go to a temp dir of its own, so it never collides with another Ray on the
machine (the default ports and ``/tmp/ray`` would). ``stop_head`` ends only what
this head started, never every Ray process on the machine as ``ray stop`` does.

The state file (``~/.cache/tandem/ray-state.json`` by default) records the Ray
address, the namespace and, for a local head, its process id, temp dir and
authentication mode.

Authentication: a local head uses Ray's token authentication (Ray's default for
new clusters) with a token of its own, made at start and kept beside the state
file (``ray-state.token``, mode 0600). Ray is pointed at it with its documented
``RAY_AUTH_TOKEN_PATH``, in the head's environment and in every driver that
connects through the state; ``~/.ray/auth_token``, which another cluster may own,
is neither read nor written. ``RAY_AUTH_MODE=disabled`` in the environment turns
authentication off for the head. A remote cluster (``--address``) is reached as
any Ray driver reaches it: ``RAY_AUTH_MODE`` and Ray's token variables decide.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.errors import TandemError
from tandem.security.files import write_private

DEFAULT_STATE = Path("~/.cache/tandem/ray-state.json")
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_ENV = "RAY_AUTH_TOKEN"  # Ray reads it before the path: never passed to our head
# Tandem moves KV over UCX, not through Ray's object store: a small one will do
# (Ray's default takes 30% of the machine's memory).
OBJECT_STORE_BYTES = 256 * 2**20


class RayDeployError(TandemError):
    """Ray is missing, unreachable, or a deployment is not where the state says."""


def state_path(path: str | Path | None) -> Path:
    return Path(path or os.environ.get("TANDEM_RAY_STATE") or DEFAULT_STATE).expanduser()


def read_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise RayDeployError(f"cannot read the state file {path}: {exc}") from exc


def write_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=2) + "\n")


def token_path(state_file: Path) -> Path:
    """Where a local head's token lives: beside its state file."""
    return state_file.with_suffix(".token")


def write_token(path: Path) -> None:
    """A fresh random token, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, secrets.token_hex(32).encode())


def auth_env(state: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """``env`` with the authentication a deployment's state records (a local head's)."""
    env = dict(env)
    if state.get("auth_mode"):
        env[AUTH_MODE_ENV] = state["auth_mode"]
    if state.get("auth_token_file"):
        env[TOKEN_PATH_ENV] = state["auth_token_file"]
        env.pop(TOKEN_ENV, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(
    num_cpus: int, resources: dict[str, float], token_file: Path, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Start a local head; returns the state to record (address, pid, temp_dir, log,
    authentication). With token authentication a new token is written to ``token_file``."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        ray_bin = shutil.which("ray")
    if not ray_bin:
        raise RayDeployError(
            "the `ray` command is missing; install Tandem with: pip install 'tandem[ray]'"
        )
    # Short: Ray's socket paths live under it and are limited to ~107 characters.
    temp_dir = tempfile.mkdtemp(prefix="tandem-ray-", dir="/tmp")
    port = _free_port()
    cmd = [
        str(ray_bin), "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1",
        "--port", str(port),
        "--ray-client-server-port", str(_free_port()),
        "--dashboard-agent-listen-port", str(_free_port()),
        "--include-dashboard", "false",
        "--dashboard-port", str(_free_port()),
        "--disable-usage-stats",
        "--num-cpus", str(num_cpus),
        "--object-store-memory", str(OBJECT_STORE_BYTES),
        "--resources", json.dumps(resources),
        "--temp-dir", temp_dir,
    ]  # fmt: skip
    log_path = Path(temp_dir) / "ray-start.log"
    # Token authentication (Ray's default for new clusters), said out loud: a driver
    # connecting later only sends the token when told the mode.
    auth: dict[str, Any] = {"auth_mode": os.environ.get(AUTH_MODE_ENV, "token")}
    if auth["auth_mode"] == "token":
        write_token(token_file)
        auth["auth_token_file"] = str(token_file)
    env = auth_env(auth, dict(os.environ))
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # not in the CLI's process group: Ctrl-C there leaves it
        )  # fmt: skip
    address = f"127.0.0.1:{port}"
    state = {
        "address": address,
        **auth,
        "head_pid": popen.pid,
        "head_started": time.time(),
        "temp_dir": temp_dir,
        "log": str(log_path),
    }
    ready = Path(temp_dir) / "ray_current_cluster"  # written once the head serves
    deadline = time.monotonic() + timeout_s
    try:
        while not ready.exists():
            if popen.poll() is not None or time.monotonic() > deadline:
                why = "exited" if popen.poll() is not None else f"was not up after {timeout_s:g} s"
                # Read before stop_head, which removes the temp dir and the log with it.
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
                raise RayDeployError(f"the local Ray head {why}; the end of its log:\n{tail}")
            time.sleep(0.2)
    except BaseException:  # a failed start, or Ctrl-C: the head is recorded nowhere yet
        stop_head(state)
        raise
    return state


def stop_head(state: dict[str, Any], timeout_s: float = 30.0) -> None:
    """SIGTERM the ``ray start --block`` process (it stops the daemons it started, and
    worker processes exit with their raylet); SIGKILL whatever of that process tree
    is still alive after ``timeout_s``."""
    import psutil  # a dependency of Ray

    procs = head_processes(state)
    for p in procs[:1]:  # the head process itself
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    temp_dir = state.get("temp_dir")
    if temp_dir and Path(temp_dir).name.startswith("tandem-ray-"):
        shutil.rmtree(temp_dir, ignore_errors=True)
    if state.get("auth_token_file"):
        Path(state["auth_token_file"]).unlink(missing_ok=True)


def head_processes(state: dict[str, Any]) -> list:
    """The local head's process and its descendants (psutil.Process), head first."""
    import psutil

    pid = state.get("head_pid")
    try:
        head = psutil.Process(pid) if pid else None
        if head is None or head.create_time() > state.get("head_started", float("inf")):
            return []  # not started, or the pid now belongs to another process
        return [head, *head.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
