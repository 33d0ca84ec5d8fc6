"""Local launcher: a router and N prefill + M decode workers as processes on loopback.

With no prefill worker (``num_prefill: 0``, router ``disaggregation.mode`` never or
conditional; ``tandem serve --colocated M``) the decode workers prefill every
prompt themselves: a colocated deployment behind the same router and API.

Start-up: every worker is started with its own YAML config (an engine thread
budget so the processes share the cores, port 0 so the OS picks free ports)
and prints ``READY <role> grpc=HOST:PORT ...`` once it serves; the router is
started last, with the workers' addresses, and its READY line gives the address
clients use. A process that exits or stays silent past ``startup_timeout_s``
fails the start with the tail of its log, and everything already started is
stopped. Shutdown: SIGTERM to the router first (it drains in-flight requests),
then to the workers, each draining for ``drain_timeout_s``, then SIGKILL for
anything still alive a few seconds after that. Each process logs to ``<run dir>/<name>.log``.

Inside, the cluster is encrypted with zero set-up: ``start`` creates a
throw-away CA, a member certificate and a KV secret for this run (in
``<run dir>/cluster/``, owner-only, deleted as soon as every process has read it:
once the router is ready, so that a launcher killed outright after that leaves no
key behind; one killed outright during start-up leaves them there, owner-only,
valid for that run's processes only), and every process
gets them through its config: the router calls the workers over mutual TLS and
the workers authenticate their KV connections. A ``cluster:`` section naming
the operator's own files is used instead; ``cluster: {insecure: true}`` runs
without (loopback only; for measuring what TLS costs).

With ``metrics: true`` (``tandem serve --metrics``) every process serves Prometheus
metrics on a free port, reported on its READY line; ``metrics_targets()`` lists
them and ``<run dir>/prometheus-targets.json`` holds them in Prometheus' file-based
service discovery format (``file_sd_configs``), labelled by process and role.

Every process is started through tandem/deploy/lifeline.py, which stops it
within seconds if the launcher dies without stopping it (SIGKILL included), so
no orphan keeps a port or memory.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.config import (
    ClusterSecurityConfig,
    DecodeConfig,
    EngineConfig,
    PrefillConfig,
    RouterConfig,
    from_dict,
    refuse_launcher_settings,
    role_config,
    router_context,
    save_yaml,
    section,
)
from tandem.deploy.lifeline import Lifeline
from tandem.engine.loader import needs_building
from tandem.errors import ConfigError, TandemError
from tandem.kv_transfer.ucx.runtime import on_gpu, ucx_env_defaults
from tandem.metrics import targets
from tandem.security.cluster import ClusterCredentials

log = logging.getLogger(__name__)

# After its drain, what a process may take to exit before it is killed.
EXIT_GRACE_S = 5.0
# The logs a run writes in its run dir, by process name.
_PROCESS_LOG = re.compile(r"(router|(prefill|decode)-\d+)\.log")


@dataclass(frozen=True)
class ClusterConfig:
    """What ``tandem serve`` starts. Role sections override the defaults derived here."""

    num_prefill: int = 1
    num_decode: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)  # for every worker
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)  # its engine is replaced
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # its engine is replaced
    # Every process's cluster credentials (the roles' own sections are replaced); no
    # files named: a throw-away set per run.
    cluster: ClusterSecurityConfig = field(default_factory=ClusterSecurityConfig)
    # default: engine.num_threads, else the cores shared out between the ranks, at least 1
    threads_per_worker: int | None = None
    # Each pool's tensor-parallel width (None: engine.tensor_parallel_size); they may
    # differ: the decode worker re-splits the heads it reads (kv_transfer/heads.py).
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    startup_timeout_s: float = 600.0  # the first start may dequantise the model
    # On stop, each process gets this long to finish its in-flight requests (the
    # router first, then the workers), and a little more to exit before it is killed.
    drain_timeout_s: float = 30.0
    # Every process serves Prometheus metrics on a free port (a role section's own
    # metrics_port wins); False: only where a role section sets one.
    metrics: bool = False
    # Where each process's config and log go, and the Prometheus targets file (None: a
    # fresh temporary directory per run). A start keeps the last run's logs as
    # NAME.log.1; one launcher at a time may use the directory.
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.num_decode < 1 or self.num_prefill < 0:
            raise ConfigError(
                f"a cluster needs >= 1 decode worker and >= 0 prefill workers, "
                f"got prefill={self.num_prefill}, decode={self.num_decode}"
            )
        self.router.disaggregation.check_prefill_workers(
            self.num_prefill, "num_prefill (--prefill)"
        )
        for pool in ("prefill", "decode"):
            width = getattr(self, f"{pool}_tensor_parallel_size")
            if width is not None and width < 1:
                raise ConfigError(f"{pool}_tensor_parallel_size must be >= 1, got {width}")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ConfigError(f"threads_per_worker must be >= 1, got {self.threads_per_worker}")
        if not 0 < self.startup_timeout_s < math.inf:
            raise ConfigError(f"startup_timeout_s must be finite and > 0, got "
                              f"{self.startup_timeout_s}")  # fmt: skip
        if not 0 <= self.drain_timeout_s < math.inf:
            raise ConfigError(
                f"drain_timeout_s must be finite and >= 0, got {self.drain_timeout_s}"
            )
        for pool in ("prefill", "decode"):
            if getattr(self, pool).metrics_port and getattr(self, f"num_{pool}") > 1:
                raise ConfigError(
                    f"{pool}.metrics_port would be every {pool} worker's: with more than one, "
                    f"set metrics: true (each process on a free port, listed in the targets file)"
                )

    def width(self, pool: str) -> int:
        """The tensor-parallel width of the "prefill" or "decode" pool's workers."""
        own = getattr(self, f"{pool}_tensor_parallel_size")
        return self.engine.tensor_parallel_size if own is None else own

    def worker_threads(self) -> int:
        """torch threads for each process that computes (each rank of each worker):
        ``threads_per_worker``, else the engine section's ``num_threads``, else the CPUs
        this process may run on (its affinity, as under a cpuset) shared out."""
        if self.threads_per_worker:
            return self.threads_per_worker
        if self.engine.num_threads:  # as on Ray: a value in the file is not dropped
            return self.engine.num_threads
        ranks = self.num_prefill * self.width("prefill") + self.num_decode * self.width("decode")
        return max(1, len(os.sched_getaffinity(0)) // ranks)  # the CPUs this may run on


def cluster_config(values: dict, where: str = "") -> ClusterConfig:
    """A ClusterConfig from YAML-shaped values (role sections nest, as in role_config)."""
    values = dict(values)
    refuse_launcher_settings(values, where)
    for key, cls in (("router", RouterConfig), ("prefill", PrefillConfig),
                     ("decode", DecodeConfig)):  # fmt: skip
        if key in values:
            values[key] = role_config(cls, section(values, key, where), f"{where} {key}".strip())
    for key, cls in (("engine", EngineConfig), ("cluster", ClusterSecurityConfig)):
        if key in values:
            values[key] = from_dict(cls, section(values, key, where), f"{where} {key}".strip())
    return from_dict(ClusterConfig, values, where=where)


class StartError(TandemError):
    """A process of the cluster failed to start; the message carries its log's tail."""


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen
    log_path: Path
    ready: dict[str, str] = field(default_factory=dict)  # parsed READY fields
    # Its stdout's reader, from the start (a pipe nobody reads would block the process
    # once full): the READY line into ``ready_line``, the rest into its log.
    reader: threading.Thread | None = None
    ready_line: list[str] = field(default_factory=list)

    def read_stdout(self) -> None:
        self.reader = threading.Thread(
            target=_read_lines, args=(self.popen.stdout, self.ready_line, self.log_path),
            daemon=True,
        )  # fmt: skip
        self.reader.start()

    def start_failure(self) -> StartError:
        self.reader.join(timeout=2)  # its last stdout lines into the log
        return StartError(
            f"{self.name} exited with code {self.popen.returncode} during start-up; "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalCluster:
    """Start with ``start()`` (returns the router address), stop with ``stop()``."""

    # The process entry points (``python -m MODULE --config FILE``, run through the lifeline).
    modules = {
        "prefill": "tandem.prefill_worker",
        "decode": "tandem.decode_worker",
        "router": "tandem.router",
    }

    def __init__(self, config: ClusterConfig, run_dir: str | Path | None = None) -> None:
        """``run_dir``: where the processes' configs and logs go (default: the config's
        ``log_dir``, else a fresh temporary directory, ``owns_run_dir``, which a ``with``
        block that ends without an error removes; after an error it is kept, unless
        the start failed before any process had a log in it)."""
        self.config = config
        run_dir = run_dir or (config.log_dir and Path(config.log_dir).expanduser())
        self.owns_run_dir = not run_dir
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="tandem-run-"))
        self._run_dir_lock: int | None = None  # held from start() to the end of stop()
        self.processes: list[_Process] = []
        self._gone: list[_Process] = []  # exited, as newly_exited reported them
        self.address: str | None = None
        self.http_address: str | None = None  # the router's OpenAI-compatible API, if on
        self._lifeline: Lifeline | None = None  # open from start() to the end of stop()
        self._own_credentials: Path | None = None  # the throw-away set's directory
        self._credentials: ClusterCredentials | None = None  # for dial(), from start()
        self.security = ClusterSecurityConfig()  # what every process got (set by start)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, kind, *exc) -> None:
        self.stop()
        if kind is None and self.owns_run_dir:  # a clean run leaves no temporary dir behind
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def start(self) -> str:
        cfg = self.config
        engine = dataclasses.replace(cfg.engine, num_threads=cfg.worker_threads())
        self._lifeline = self._lifeline or Lifeline()
        try:
            self._lock_run_dir()
            if (self.run_dir / "prometheus-targets.json").exists():
                self._write_targets()  # none yet: a killed launcher's would be scraped on
            cluster = self.security = self._cluster_security()
            self._credentials = ClusterCredentials.load(cluster)
            prefill_cfg = dataclasses.replace(
                cfg.prefill,
                engine=dataclasses.replace(engine, tensor_parallel_size=cfg.width("prefill")),
                port=0,
                cluster=cluster,
                drain_timeout_s=cfg.drain_timeout_s,
                **self._metrics(cfg.prefill),
            )
            decode_cfg = dataclasses.replace(
                cfg.decode,
                engine=dataclasses.replace(engine, tensor_parallel_size=cfg.width("decode")),
                port=0,
                kv_port=0,
                cluster=cluster,
                drain_timeout_s=cfg.drain_timeout_s,
                **self._metrics(cfg.decode),
            )
            workers = [("prefill", i, prefill_cfg) for i in range(cfg.num_prefill)]
            workers += [("decode", i, decode_cfg) for i in range(cfg.num_decode)]
            started = []
            if len(workers) > 1 and needs_building(engine.model, engine.cache_dir):
                # A first start: one worker builds the model's directory (and its packed
                # codes) for all, where each would have built its own copy at once.
                log.info("first start of %s: one worker prepares it for the others",
                         engine.model)  # fmt: skip
                role, i, worker_cfg = workers.pop(0)
                started.append(self._spawn(f"{role}-{i}", self.modules[role], worker_cfg))
                self._wait_ready(started[0])
            started += [self._spawn(f"{role}-{i}", self.modules[role], worker_cfg)
                        for role, i, worker_cfg in workers]  # fmt: skip
            for p in started:
                if not p.ready:
                    self._wait_ready(p)
            prefill = [p for p in started if p.name.startswith("prefill-")]
            decode = [p for p in started if p.name.startswith("decode-")]
            router_cfg = dataclasses.replace(
                cfg.router,
                model=engine.model,
                cache_dir=engine.cache_dir,
                max_model_len=router_context(cfg.router.max_model_len, engine.max_model_len),
                prefill_workers=tuple(p.ready["grpc"] for p in prefill),
                decode_workers=tuple(p.ready["grpc"] for p in decode),
                cluster=cluster,
                drain_timeout_s=cfg.drain_timeout_s,
                **self._metrics(cfg.router),
            )
            router = self._spawn("router", self.modules["router"], router_cfg)
            self._wait_ready(router)
            # Every process has read the throw-away set: off the disk, where a launcher
            # killed outright would leave it.
            self._forget_credentials()
        except BaseException:
            self.stop()
            self._drop_unused_run_dir()
            raise
        self.address = router.ready["grpc"]
        http = router.ready.get("http", "-")
        self.http_address = None if http == "-" else http
        if self.metrics_targets():
            self._write_targets()
        return self.address

    def _metrics(self, role_config) -> dict:
        """The metrics_port to give a process: its section's own, else 0 (any free
        port) when the cluster's ``metrics`` is on."""
        if role_config.metrics_port is None and self.config.metrics:
            return {"metrics_port": 0}
        return {}

    def metrics_targets(self) -> dict[str, str]:
        """Each serving process's metrics address ("host:port"), by process name."""
        return {
            p.name: p.ready["metrics"] for p in self.processes if p.ready.get("metrics", "-") != "-"
        }

    def _write_targets(self) -> None:
        """``<run dir>/prometheus-targets.json``: Prometheus file_sd, one group per process."""
        targets.write(self.run_dir / "prometheus-targets.json", [
            targets.group(address, name, name.split("-")[0])
            for name, address in self.metrics_targets().items()
        ])  # fmt: skip

    def _cluster_security(self) -> ClusterSecurityConfig:
        """The operator's files (checked now), none (``insecure``), or a throw-away set."""
        own = self.config.cluster
        if ClusterCredentials.load(own) is not None or own.insecure:
            return own
        self._own_credentials = self.run_dir / "cluster"
        return ClusterCredentials.create().write(self._own_credentials)

    def dial(self, address: str) -> grpc.Channel:
        """A blocking channel to one of this cluster's processes, as a member."""
        credentials = self._credentials
        return grpc.insecure_channel(address) if credentials is None else credentials.dial(address)

    def _spawn(self, name: str, module: str, config) -> _Process:
        config_path = self.run_dir / f"{name}.yaml"
        save_yaml(config_path, config)
        log_path = self.run_dir / f"{name}.log"
        engine = getattr(config, "engine", None)  # workers have one, the router not
        env = ucx_env_defaults(dict(os.environ), cuda=engine is not None and on_gpu(engine.device))
        threads = str(config.engine.num_threads) if hasattr(config, "engine") else "1"
        env["OMP_NUM_THREADS"] = threads  # BLAS pools size themselves from it
        log_path.write_bytes(b"")
        popen = subprocess.Popen(
            self._lifeline.command(module, ["--config", str(config_path)]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # for the READY line; the rest goes to the log
            stderr=log_path.open("ab"),  # appends, as the stdout reader does: no overwrites
            env=self._lifeline.env(env),
            pass_fds=self._lifeline.pass_fds,
            start_new_session=True,  # a Ctrl-C reaches the launcher, which stops us in order
        )
        proc = _Process(name, popen, log_path)
        proc.read_stdout()
        self.processes.append(proc)
        return proc

    def _wait_ready(self, proc: _Process) -> None:
        """Until ``proc``'s READY line. Any process started that exits meanwhile fails
        the start at once: one that dies while an earlier one still loads is not
        found only after that one is ready (or blamed on its timeout)."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.ready_line:
                line = proc.ready_line[0]
                proc.ready = dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)
                log.info("%s ready: %s", proc.name, line.strip())
                return
            for p in self.processes:
                if p.popen.poll() is not None:
                    raise p.start_failure()
            time.sleep(0.05)
        raise StartError(
            f"{proc.name} was not ready after {self.config.startup_timeout_s:.0f} s; "
            f"last lines of {proc.log_path}:\n{proc.log_tail()}"
        )

    def stop(self) -> None:
        """Router first (it drains), then workers; SIGKILL ``EXIT_GRACE_S`` after the
        drain timeout.

        Each process leads a process group of its own, with its tensor-parallel ranks
        in it: a stopped (SIGSTOP) member is continued so that it gets the SIGTERM,
        and whatever of the group is left after the process ends or is killed (a rank
        stuck in a collective) is killed with it. The credentials and the lifeline go
        however the stop ends (a second Ctrl-C included)."""
        try:
            ordered = sorted(self.processes, key=lambda p: p.name != "router")
            for group in (ordered[:1], ordered[1:]):
                for p in group:
                    if p.popen.poll() is None:
                        _signal_group(p, signal.SIGCONT)
                        p.popen.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + self.config.drain_timeout_s + EXIT_GRACE_S
                for p in group:
                    try:
                        p.popen.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        log.warning("%s did not stop in time; killing it", p.name)
                    _signal_group(p, signal.SIGKILL)
                    p.popen.wait()
            self.processes.clear()
            self._gone.clear()
            if (
                self._run_dir_lock is not None
                and (self.run_dir / "prometheus-targets.json").exists()
            ):
                self._write_targets()  # none: Prometheus stops scraping the old addresses
        finally:
            self._forget_credentials()
            if self._lifeline is not None:
                self._lifeline.close()
                self._lifeline = None
            if self._run_dir_lock is not None:
                os.close(self._run_dir_lock)  # and with it the lock
                self._run_dir_lock = None

    def _drop_unused_run_dir(self) -> None:
        """A start that failed before it started any process (a cluster file it cannot
        read, a Ctrl-C while the model was looked up) has nothing to show in a run dir
        of its own making: removed, or each such failure left an empty tandem-run-* in
        the temporary directory. Once a process has a log there, the dir is kept: the
        failure's explanation is in it."""
        if self.owns_run_dir and not any(self.run_dir.glob("*.log")):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _lock_run_dir(self) -> None:
        """Makes the run dir and takes it for this launcher: two clusters writing the same
        logs, configs and targets file would garble each other's (``log_dir``)."""
        if self._run_dir_lock is not None:
            return
        try:
            self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # as mkdtemp's
            if self.run_dir.stat().st_mode & 0o002:  # /tmp: a link planted there redirects
                raise OSError(0, "every user may write there")  # our writes; ssh refuses so
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(self.run_dir / ".lock", flags, 0o600)
        except OSError as exc:  # a file in the way, a read-only disk: a setting to fix
            raise ConfigError(f"cannot use the log directory {self.run_dir}: {exc.strerror} "
                              "(log_dir, --log-dir)") from None  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"the log directory {self.run_dir} is in use by another launcher (pid "
                f"{holder}); give this one its own (log_dir, --log-dir)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._run_dir_lock = fd
        # The last run's logs are kept once, each as NAME.log.1, all of them: a log of a
        # process this run does not start (a decode-1 of a larger run) is not left to
        # read as this run's.
        for path in self.run_dir.glob("*.log"):
            if _PROCESS_LOG.fullmatch(path.name) and path.stat().st_size:
                path.replace(path.with_name(f"{path.name}.1"))

    def newly_exited(self) -> list[_Process]:
        """The processes that have exited since the last call (this launcher does not
        restart them: the router moves a dead worker's requests to the others)."""
        gone = [p for p in self.processes if p.popen.poll() is not None and p not in self._gone]
        self._gone += gone
        return gone

    def _forget_credentials(self) -> None:
        """The throw-away key and KV secret leave the disk (``dial`` keeps a copy)."""
        if self._own_credentials is not None:
            shutil.rmtree(self._own_credentials, ignore_errors=True)
            self._own_credentials = None


def _signal_group(proc: _Process, sig: int) -> None:
    try:
        os.killpg(proc.popen.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def _read_lines(stream, ready: list[str], log_path: Path) -> None:
    """A process's stdout until it closes: the first READY line into ``ready``, every
    other line into its log (what a library prints there, UCX's lines included)."""
    with log_path.open("ab") as out:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            if not ready and line.startswith("READY "):
                ready.append(line)
            else:
                out.write(raw)
                out.flush()
