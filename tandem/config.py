"""Frozen, validated configuration per role, loadable from YAML.

Each field is a setting an operator can name in a YAML file or a CLI flag; a bad
value fails at start-up with the setting named.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tandem.errors import ConfigError
from tandem.keepalive import MAX_KEEPALIVE_S

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # bfloat16 on CUDA and on CPUs with native bf16, else float32
    device: str = "auto"  # cuda if available, else cpu
    block_size: int = 16
    num_blocks: int | None = None  # wins over kv_cache_bytes when set
    kv_cache_bytes: int = 512 * 2**20
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # triton on CUDA, cpu on CPU (when they load), else torch
    # auto: the model's dtype. int8: each token's K and V per head as int8 with a float16
    # scale (absmax / 127), 0.52x the bytes of bfloat16 in memory, on the wire and per
    # decode step; a small loss of quality (bench/kv_int8.py). A KV transfer
    # needs the same on both sides (the handshake names it).
    kv_cache_dtype: str = "auto"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    cache_dir: str | None = None  # dequantised GGUF and tiny-random; default ~/.cache/tandem
    # Decode side (a KV transfer's reservation, or a prompt prefilled on the decode
    # worker): how many more output tokens get blocks up front, at most max_tokens.
    # The sequence grows past them block by block; when blocks run out, the most
    # recently admitted running sequence is preempted and recomputed later (never
    # failed). None: all of max_tokens up front (the worst case; no preemption, but
    # concurrency capped by what clients ask for rather than what they use).
    reserve_output_tokens: int | None = 128
    # Bounded memory for long contexts (StreamingLLM's attention sinks + sliding window),
    # a quality trade-off and off by default: a sequence keeps the KV of its first
    # kv_sink_tokens tokens (rounded up to whole blocks) and of at least its last
    # kv_window_tokens (whole blocks), freeing the blocks in between as it grows, so
    # its memory stays constant. Positions stay the original ones (RoPE as computed).
    kv_window_tokens: int | None = None
    kv_sink_tokens: int = 4
    # A tier of KV blocks in host memory behind the cache (pinned when the cache is on
    # a GPU): evicted prefix blocks and preempted sequences go there instead of being
    # recomputed. 0: none. Off by default: on a CPU the cache already is host memory,
    # and the same bytes in kv_cache_bytes serve at least as well.
    host_kv_cache_bytes: int = 0
    # The model split over this many processes and devices (tandem/engine/parallel.py:
    # heads and MLP split, one all-reduce after each of a layer's two halves); must
    # divide the model's attention heads and MLP width. kv_cache_bytes and
    # host_kv_cache_bytes are per rank.
    # KV moves between workers of any widths on the host (a decode worker re-splits
    # the heads it reads); tensor-parallel caches on GPUs are not transferable yet
    # (the KV handshake says so).
    tensor_parallel_size: int = 1
    # A GGUF model whose projections are stored as Q4_1 (the default model), run on a
    # CPU by one process: steps of at most this many rows (decode batches that small)
    # read the codes as stored (tandem/engine/gguf_int4.py; bench/linear_forms.py
    # measures where that pays). bfloat16: a quarter of the dense weights' bytes, up to
    # 64 rows on a CPU with AMX (and the LM head from its 8-bit codes), up to 8
    # elsewhere; float32: under a fifth, and the 8-bit head, up to 16 rows (8 with
    # AVX-512); whatever is set here. Larger steps use the dense weights, so a
    # request's bfloat16 tokens can depend on how many others share its steps
    # (float32 ones only in the last bits of the sums). 0: never.
    int4_max_rows: int = 64

    def __post_init__(self) -> None:
        bs = self.block_size
        if bs < 1 or bs & (bs - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {bs}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes < 1:
            raise ConfigError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.kv_window_tokens is not None and self.kv_window_tokens < 1:
            raise ConfigError(
                "kv_window_tokens must be >= 1 (or null: keep every token's KV), "
                f"got {self.kv_window_tokens}"
            )
        if self.host_kv_cache_bytes < 0:
            raise ConfigError(
                "host_kv_cache_bytes must be >= 0 (0: no host tier), "
                f"got {self.host_kv_cache_bytes}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.int4_max_rows < 0:
            raise ConfigError(f"int4_max_rows must be >= 0 (0: never), got {self.int4_max_rows}")
        if self.kv_sink_tokens < 0:
            raise ConfigError(f"kv_sink_tokens must be >= 0, got {self.kv_sink_tokens}")
        if self.reserve_output_tokens is not None and self.reserve_output_tokens < 1:
            raise ConfigError(
                "reserve_output_tokens must be >= 1 (or null: all of max_tokens), "
                f"got {self.reserve_output_tokens}"
            )


T = TypeVar("T")


def from_dict(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    """Build a config dataclass, rejecting unknown keys and values of the wrong type
    by name: YAML's ``insecure: "false"`` is a string, which Python would take as true,
    and ``port: 50051.9`` or ``block_size: "16"`` would fail later with a traceback."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
            f"{' in ' + where if where else ''} (known: {', '.join(sorted(names))})"
        )
    hints = typing.get_type_hints(cls)
    try:
        for name, value in values.items():
            if not _is(value, hints[name]):
                raise ConfigError(f"{name} must be {_expected(hints[name])}, got {_kind(value)}")
        return cls(**values)
    except ConfigError as exc:
        if not where:
            raise
        raise ConfigError(f"{exc} (in {where})") from exc


def section(values: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    """``values[key]``, a section of settings: a mapping, and an absent or empty one
    (null in YAML) holds the defaults."""
    value = values.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping of settings, got {_kind(value)}"
                          f"{' (in ' + where + ')' if where else ''}")  # fmt: skip
    return value


def _is(value: Any, hint: Any) -> bool:
    """Whether a YAML-loaded ``value`` has the annotated type (types this module does
    not know pass: the dataclass checks them)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # YAML's .nan passes every "< 0" check, .inf every "> 0" one
        if isinstance(value, float):  # (a lease or timeout of .inf never ends)
            return math.isfinite(value)
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is tuple:  # tuple[X, ...] from a YAML list
        arm = typing.get_args(hint)[0]
        return isinstance(value, (list, tuple)) and all(_is(v, arm) for v in value)
    if typing.get_origin(hint) is dict or hint is dict:
        return isinstance(value, dict)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint)
    return True


def _expected(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_expected(arm) for arm in typing.get_args(hint))
    names = {type(None): "null", bool: "true or false", int: "a whole number",
             float: "a finite number", str: "a string"}  # fmt: skip
    if hint in names:
        return names[hint]
    if typing.get_origin(hint) is tuple:
        return f"a list of {_expected(typing.get_args(hint)[0]).removeprefix('a ')}s"
    return "a mapping" if dataclasses.is_dataclass(hint) or hint is dict else str(hint)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return f"{value!r} ({type(value).__name__})"


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's settings (an empty file: none). Stricter than YAML itself, which
    keeps the last of a key given twice: a second ``router:`` section dropped the first,
    and with it ``api_keys_file``, so the router served anyone. Names are strings: YAML
    reads ``on:`` as true and ``1:`` as a number."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # <<: keys it sets may be
                    continue  # set again here, which is what merging is for
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, str):
                    raise ConfigError(f"config {path}:{line}: a setting's name must be a "
                                      f"string, got {_kind(key)}; quote it")  # fmt: skip
                if key in seen:
                    raise ConfigError(
                        f"config {path}:{line}: {key} is set twice (first on line {seen[key]})"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep)

    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=Loader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config {path} must be a mapping at the top level, got {type(data).__name__}"
        )
    return data


@dataclass(frozen=True)
class ClusterSecurityConfig:
    """Files that make a process a member of one cluster (see tandem/security/cluster.py).

    All four or none. None: the process talks to its peers without TLS and its KV
    connections are unauthenticated, which a worker allows only on loopback unless
    ``insecure`` is set. ``tandem serve`` and ``tandem ray up`` fill them in.
    """

    ca_file: str = ""  # the cluster CA (PEM): peers must present a certificate it signed
    cert_file: str = ""  # this member's certificate (PEM), presented as server and client
    key_file: str = ""  # its private key (PEM); keep it owner-only
    kv_secret_file: str = ""  # the shared KV secret (>= 16 bytes; owner-only)
    # The name clients check in a member's certificate instead of the address they
    # dialled (members' addresses are known only at run time); "" checks the address.
    server_name: str = "tandem-cluster"
    # A worker bound to a non-loopback address without the files above refuses to
    # start unless this is set: anyone who reaches the port could call it.
    insecure: bool = False


DEFAULT_KV_BACKEND = "ucx"
# A worker whose engine spends longer than this in one step (or one command between
# steps) is hung, not busy: a step takes seconds at most. It exits, so that the router
# moves its streams and its supervisor (Ray) starts a new one (worker/server.py).
# 0: no watchdog.
ENGINE_STALL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class PrefillConfig:
    """A prefill worker: computes prompts and pushes their KV to decode workers."""

    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 0  # gRPC port; 0 picks a free one
    worker_id: str = ""  # default: prefill-<host>:<port>
    # ucx (the decode worker reads the blocks straight out of this worker's cache:
    # tandem/kv_transfer/ucx/rma.py) or inproc (tests)
    kv_backend: str = DEFAULT_KV_BACKEND
    kv_ack_timeout_s: float = 30.0  # wait for the decode side to confirm a transfer
    kv_connect_timeout_s: float = 10.0  # connecting to a decode worker's KV receiver
    # Ship each layer's KV as soon as the prefill has computed it, so that the transfer
    # overlaps the layers after it; False: all layers in one message after the prompt.
    kv_layerwise: bool = True
    drain_timeout_s: float = 20.0  # on SIGTERM, in-flight requests get this long to finish
    engine_stall_timeout_s: float = ENGINE_STALL_TIMEOUT_S
    # Prefill calls in this worker (queued, computing or shipping KV); beyond it a call
    # gets RESOURCE_EXHAUSTED and the router tries another worker. Bounds the memory a
    # burst can take here; as large as a router's own max_queue.
    max_queue: int = 256
    # Prometheus metrics over HTTP on this host (tandem/metrics/); 0 picks a free
    # port (reported on the READY line); None: off.
    metrics_port: int | None = None
    cluster: ClusterSecurityConfig = dataclasses.field(default_factory=ClusterSecurityConfig)

    def __post_init__(self) -> None:
        _check_worker(self)
        check_metrics_port(self.metrics_port)
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.kv_ack_timeout_s <= 0:
            raise ConfigError(f"kv_ack_timeout_s must be > 0, got {self.kv_ack_timeout_s}")
        if self.kv_connect_timeout_s <= 0:
            raise ConfigError(f"kv_connect_timeout_s must be > 0, got {self.kv_connect_timeout_s}")


@dataclass(frozen=True)
class DecodeConfig:
    """A decode worker: reserves KV blocks, receives KV, decodes with continuous batching."""

    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 0  # gRPC port; 0 picks a free one
    worker_id: str = ""  # default: decode-<host>:<port>
    kv_backend: str = DEFAULT_KV_BACKEND  # as the prefill workers': both must agree
    kv_port: int = 0  # the KV receiver's listener; 0 picks a free one
    kv_lease_s: float = 30.0  # reserved blocks are freed if the KV has not arrived by then
    drain_timeout_s: float = 20.0  # on SIGTERM, in-flight requests get this long to finish
    engine_stall_timeout_s: float = ENGINE_STALL_TIMEOUT_S
    # Prometheus metrics over HTTP on this host (tandem/metrics/); 0 picks a free
    # port (reported on the READY line); None: off.
    metrics_port: int | None = None
    cluster: ClusterSecurityConfig = dataclasses.field(default_factory=ClusterSecurityConfig)

    def __post_init__(self) -> None:
        _check_worker(self)
        check_metrics_port(self.metrics_port)
        if not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_port must be in [0, 65535], got {self.kv_port}")
        if self.kv_lease_s <= 0:
            raise ConfigError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")


def host_port(host: str, port: int) -> str:
    """A listening address as peers dial it: "host:port", an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_address(address: str, setting: str, port_required: bool = True) -> None:
    """Refuse a "host:port" or "[v6]:port" whose port is not a number in [1, 65535]:
    gRPC reads port 99999 as 99999 mod 65536 and dials 34463, which may be another
    server. ``port_required`` False: a bare host (gRPC's default port) is allowed."""
    if address.startswith("["):
        end = address.find("]")
        rest = address[end + 1 :] if end > 0 else "?"
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{setting} {address!r} is not host:port or [v6]:port")
        port = rest[1:] if rest else None
    else:  # two or more colons and no brackets: a bare IPv6 host, as gRPC reads it
        port = address.rpartition(":")[2] if address.count(":") == 1 else None
    if port is None:
        if port_required:
            raise ConfigError(f"{setting} {address!r} has no port (host:port or [v6]:port)")
        return
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(
            f"{setting} {address!r}: the port must be a number in [1, 65535], got {port!r}"
        )


def check_metrics_port(port: int | None) -> None:
    if port is not None and not 0 <= port < 65536:
        raise ConfigError(f"metrics_port must be in [0, 65535] (0: any free port), got {port}")


PLACEMENT_POLICIES = ("least-loaded", "round-robin", "prefix-aware")
DISAGGREGATION_MODES = ("always", "conditional", "never")


@dataclass(frozen=True)
class DisaggregationConfig:
    """Where each request's prompt is prefilled (tandem/router/disaggregation.py).

    ``always``: on the prefill pool, its KV shipped to the decode worker (a pool with no
    live worker is UNAVAILABLE). ``never``: on the decode worker itself, no KV moved (a
    colocated deployment; no prefill pool needed). ``conditional``: per request, on
    the decode worker when the prompt is short or the prefill pool busy (unless the
    prefill would stall a busy decode worker's streams by more than
    ``local_max_stall_ms``), or when the pool has no live worker; on the prefill pool
    otherwise. In every mode, a stream moved onto a decode worker with a KV window is
    prefilled there (disaggregation.py).
    """

    mode: str = "always"
    # conditional: prompts (plus tokens a migrated request already has) of at most this
    # many tokens are prefilled on the decode worker: their transfer and the extra hop
    # cost more than the prefill they would take off it.
    local_max_tokens: int = 128
    # conditional: when every live prefill worker has at least this many (>= 1)
    # requests waiting, a prompt is prefilled on the decode worker instead (if that
    # worker runs at most local_max_running streams, whose tokens the prefill would delay).
    prefill_queue_max: int = 4
    local_max_running: int = 8
    # conditional: a decode worker with streams running prefills a prompt itself only
    # if that adds at most this many milliseconds to the step its streams wait out
    # (the prompt's tokens at the worker's recent cost per prompt token, from its
    # Status): the stall in their token stream. 0: no such limit.
    local_max_stall_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.mode not in DISAGGREGATION_MODES:
            raise ConfigError(
                f"disaggregation.mode must be one of {', '.join(DISAGGREGATION_MODES)}, "
                f"got {self.mode!r}"
            )
        for name, least in (("local_max_tokens", 0), ("prefill_queue_max", 1),
                            ("local_max_running", 0)):  # fmt: skip
            value = getattr(self, name)
            # (1: a prefill pool with nothing waiting is not busy)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"disaggregation.{name} must be a whole number >= {least}, "
                                  f"got {value!r}")  # fmt: skip
        stall = self.local_max_stall_ms
        if (
            isinstance(stall, bool)
            or not isinstance(stall, int | float)
            or not (math.isfinite(stall) and stall >= 0)
        ):
            raise ConfigError("disaggregation.local_max_stall_ms must be finite and >= 0 "
                              f"(0: no limit), got {stall!r}")  # fmt: skip

    def check_prefill_workers(self, n: int, setting: str) -> None:
        """A deployment's prefill worker count (``setting`` names it) against the mode."""
        if n == 0 and self.mode == "always":
            raise ConfigError(
                "a deployment with no prefill worker needs router.disaggregation.mode "
                f"'never' (colocated: decode workers prefill every prompt) or 'conditional' "
                f"({setting} is 0)"
            )
        if n > 0 and self.mode == "never":
            raise ConfigError(
                f"router.disaggregation.mode 'never' sends nothing to the {n} prefill "
                f"workers: set {setting} 0, or mode 'conditional'"
            )


@dataclass(frozen=True)
class RouterConfig:
    """The public entry point: validates, tokenizes, places and relays requests."""

    model: str = "smollm2-135m-instruct"  # for the tokenizer, chat template and limits
    cache_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    # Prometheus metrics over HTTP (tandem/metrics/); 0: a free port; None: off.
    metrics_port: int | None = None
    # Where metrics_port listens. They take no API key and name every worker's address,
    # so None is ``host`` only when that is loopback, else 127.0.0.1: give an address
    # inside the cluster's network for a Prometheus elsewhere.
    metrics_host: str | None = None
    # The OpenAI-compatible HTTP API on ``host`` (tandem/router/http/), same TLS and keys
    # as the gRPC port; 0: a free port; None: off.
    http_port: int | None = None
    prefill_workers: tuple[str, ...] = ()  # "host:port" gRPC addresses
    decode_workers: tuple[str, ...] = ()
    # The router's credentials as a cluster member: mutual TLS to the workers.
    cluster: ClusterSecurityConfig = dataclasses.field(default_factory=ClusterSecurityConfig)
    placement: str = "least-loaded"  # or round-robin, prefix-aware (router/placement.py)
    # prefix-aware: the worker with the longest cached prefix is passed over (for the
    # least loaded) when it has more than this many requests waiting and running
    # beyond the least loaded worker's.
    prefix_imbalance_max: int = 8
    # Each API key's prompts have a prefix cache of their own on the workers, so that a
    # key's caller cannot tell from its time to first token whether a prompt was sent
    # recently under another key. True: keys share cached prefixes (where every key
    # belongs to one party and they share long system prompts).
    prefix_cache_across_keys: bool = False
    disaggregation: DisaggregationConfig = dataclasses.field(default_factory=DisaggregationConfig)
    max_queue: int = 256  # requests admitted and not finished; beyond: RESOURCE_EXHAUSTED
    # An admitted request that finds every decode worker full waits this long for room
    # (or until its deadline), then gets RESOURCE_EXHAUSTED.
    queue_timeout_s: float = 120.0
    # A stream whose client takes none of what is ready for it this long (it stopped
    # reading, with its flow-control window full) is ended (gRPC: CANCELLED; HTTP: the
    # connection closed): it held its place in max_queue and its key's max_streams
    # for as long as the client liked.
    stream_stall_timeout_s: float = 60.0
    # A request whose decode or prefill worker dies mid-stream continues on another
    # worker (prompt + tokens already streamed re-prefilled) at most this many times.
    max_migrations: int = 2
    # A prefill worker that gives no first token this long after the call (its queue
    # and the prompt's compute): the call is cancelled and the request ends
    # RESOURCE_EXHAUSTED (overload; the worker is not taken for dead). The router
    # renews the decode worker's lease while the call is open, so without this bound a
    # hung prefill engine would hold the reservation as long as the client waits.
    # 0: no bound.
    prefill_timeout_s: float = 300.0
    # After a KV transfer from a prefill worker to a decode worker fails, that decode
    # worker's requests go to other prefill workers, where there are any, for this
    # long: a KV path that one host cannot reach would otherwise fail (and migrate)
    # every request placed on it, each after the transfer's timeouts. 0: off.
    kv_path_cooldown_s: float = 60.0
    status_interval_s: float = 0.5  # how often workers' Status is polled
    # A worker is taken out of placement at once when its connection fails (refused,
    # reset, keepalive); a worker whose connection is up but whose Status has gone
    # unanswered this long is taken for hung. Status never waits for the engine, so
    # this only has to outlast a stalled process, not a long engine step.
    worker_timeout_s: float = 30.0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    drain_timeout_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    # A worker that leaves a ping unanswered this long (pinged every worker_keepalive_s
    # while requests are open to it) fails those requests with UNAVAILABLE.
    worker_keepalive_s: float = 10.0
    worker_keepalive_timeout_s: float = 5.0

    # ---- The public port (tandem/router/public_port.py, auth.py, limits.py) ----
    # TLS for clients (PEM; both or neither). Without them the port speaks plaintext,
    # which the router allows only on a loopback host unless ``insecure`` is set.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # Mutual TLS: every client must present a certificate this CA (PEM) signed. It
    # authenticates clients by itself, with or without API keys.
    tls_client_ca_file: str = ""
    # API keys, one a line (format in tandem/router/auth.py); TANDEM_API_KEYS (comma-
    # separated) adds more. A key never goes on a command line, where ps shows it.
    api_keys_file: str = ""
    # Generate streams and Tokenize calls one key may have open at once (0: no limit;
    # a keys-file line may set its own). A quarter of max_queue: one runaway or leaked
    # key cannot take the whole router, and a single-tenant deployment raises it.
    key_max_streams: int = 64
    # Calls per second per key, a token bucket with a burst of max(1, rate); 0: no
    # rate limit. Off by default: a stream's cost is its tokens, which key_max_streams
    # and max_queue bound, and any fixed rate would throttle legitimate batch clients
    # (`tandem bench load` tokenizes its whole dataset first). Set it per key for tiers.
    key_requests_per_s: float = 0.0
    # Allow a non-loopback host without TLS or without authentication (e.g. TLS ends
    # at a proxy in front of the router). Off: such a router refuses to start.
    insecure: bool = False
    # The largest request message accepted (gRPC answers RESOURCE_EXHAUSTED above it).
    # 4 MiB, gRPC's own default: room for a prompt at max_prompt_chars for contexts up
    # to 16k tokens even in 4-byte characters (ASCII: 128k), while no call can make the
    # router buffer more. Raise it with max_prompt_chars for longer contexts.
    max_request_bytes: int = 4 * 2**20
    # Input limits, checked before tokenizing so that no request can hold a tokenizer
    # thread for long (tandem/router/limits.py). None: 32 characters per token of
    # context (262,144 for an 8k context). English runs about 4 characters a token and
    # whitespace-heavy code rarely above 10; 32 refuses nothing that fits the context
    # while bounding tokenizer time (~0.25 s at the limit for an 8k context). Chat
    # counts the characters of every message's content.
    max_prompt_chars: int | None = None
    max_stop_strings: int = 16  # every stop string is matched against every new token
    max_stop_chars: int = 256  # per stop string: a delimiter, not a document
    # OpenAI's bound on a chat's messages; an 8k context holds far fewer turns.
    max_chat_messages: int = 2048

    @property
    def metrics_bind_host(self) -> str:
        """Where metrics_port listens (see ``metrics_host``)."""
        from tandem.security.tls import is_loopback

        if self.metrics_host is not None:
            return self.metrics_host
        return self.host if is_loopback(self.host) else "127.0.0.1"

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill_workers", tuple(self.prefill_workers))
        object.__setattr__(self, "decode_workers", tuple(self.decode_workers))
        for name in ("prefill_workers", "decode_workers"):
            for address in getattr(self, name):
                check_address(address, name)
        if self.placement not in PLACEMENT_POLICIES:
            raise ConfigError(
                f"placement must be one of {', '.join(PLACEMENT_POLICIES)}, got {self.placement!r}"
            )
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        check_metrics_port(self.metrics_port)
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ConfigError(f"http_port must be in [0, 65535] (0: any free port), got "
                              f"{self.http_port}")  # fmt: skip
        # One port for two listeners fails only once the workers have loaded.
        ports = {"port": self.port, "http_port": self.http_port, "metrics_port": self.metrics_port}
        taken: dict[int, str] = {}
        for name, number in ports.items():
            if number:  # None or 0 (any free port) cannot clash
                if number in taken:
                    raise ConfigError(f"{name} and {taken[number]} are both {number}: one "
                                      "listener each")  # fmt: skip
                taken[number] = name
        if self.status_interval_s <= 0 or self.worker_timeout_s <= 0:
            raise ConfigError("status_interval_s and worker_timeout_s must be > 0")
        if self.queue_timeout_s < 0:
            raise ConfigError(f"queue_timeout_s must be >= 0, got {self.queue_timeout_s}")
        if not self.stream_stall_timeout_s > 0:
            raise ConfigError(
                f"stream_stall_timeout_s must be > 0, got {self.stream_stall_timeout_s}"
            )
        for name in ("prefill_timeout_s", "kv_path_cooldown_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_migrations", "prefix_imbalance_max"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        for name in ("worker_keepalive_s", "worker_keepalive_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= MAX_KEEPALIVE_S:  # gRPC's int32 milliseconds (inf too)
                raise ConfigError(
                    f"{name} must be seconds in (0, {MAX_KEEPALIVE_S:,}], got {value}"
                )
        self._check_public_port()

    def _check_public_port(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = (
                ("tls_cert_file", "tls_key_file")
                if self.tls_cert_file
                else ("tls_key_file", "tls_cert_file")
            )
            raise ConfigError(f"TLS needs both tls_cert_file and tls_key_file; {given} "
                              f"given, {missing} missing")  # fmt: skip
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError(
                "tls_client_ca_file (mutual TLS) needs the router's own tls_cert_file "
                "and tls_key_file"
            )
        if self.key_max_streams < 0:
            raise ConfigError(
                f"key_max_streams must be >= 0 (0: no limit), got {self.key_max_streams}"
            )
        if not (self.key_requests_per_s >= 0 and math.isfinite(self.key_requests_per_s)):
            raise ConfigError(
                f"key_requests_per_s must be finite and >= 0 (0: no limit), "
                f"got {self.key_requests_per_s}"
            )
        if not 1024 <= self.max_request_bytes < 2**31:  # gRPC's limit is an int32
            raise ConfigError(
                f"max_request_bytes must be in [1024, {2**31 - 1:,}], got {self.max_request_bytes}"
            )
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ConfigError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        for name in ("max_stop_strings", "max_stop_chars", "max_chat_messages"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


def _check_worker(config: PrefillConfig | DecodeConfig) -> None:
    if not 0 <= config.port < 65536:
        raise ConfigError(f"port must be in [0, 65535], got {config.port}")
    if config.kv_backend not in ("ucx", "inproc"):
        raise ConfigError(f"kv_backend must be ucx or inproc, got {config.kv_backend!r}")
    if config.drain_timeout_s < 0:
        raise ConfigError(f"drain_timeout_s must be >= 0, got {config.drain_timeout_s}")
    if config.engine_stall_timeout_s < 0:
        raise ConfigError(
            f"engine_stall_timeout_s must be >= 0 (0: off), got {config.engine_stall_timeout_s}"
        )


def role_config(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    """A PrefillConfig / DecodeConfig / RouterConfig from a mapping; ``engine:``,
    ``cluster:`` and ``disaggregation:`` nest."""
    values = dict(values)
    nesting = (
        ("engine", EngineConfig),
        ("cluster", ClusterSecurityConfig),
        ("disaggregation", DisaggregationConfig),
    )
    for key, nested in nesting:
        if key in values:
            values[key] = from_dict(nested, section(values, key, where), f"{where} {key}".strip())
    return from_dict(cls, values, where=where)


# What a launcher (``tandem serve``, ``tandem ray up``) sets in each process's config
# itself, so that a value in the file would be dropped without a word: why, by setting.
LAUNCHER_SETS = {
    "router": {
        "model": "the router serves the workers' model: set engine.model",
        "cache_dir": "set engine.cache_dir",
        "prefill_workers": "the launcher registers the workers it starts",
        "decode_workers": "the launcher registers the workers it starts",
        "cluster": "set the top-level cluster: section",
    },
    **{pool: {
        "engine": "every worker takes the top-level engine: section",
        "port": "each worker takes a free port",
        "cluster": "set the top-level cluster: section",
        "kv_backend": "a deployment's workers are separate processes: the KV moves over "
                      "ucx (inproc serves one process only, in tests)",
        "worker_id": "each worker is named by its role and address",
    } for pool in ("prefill", "decode")},
}  # fmt: skip
LAUNCHER_SETS["decode"]["kv_port"] = "each worker takes a free port"
for _owned in LAUNCHER_SETS.values():
    _owned["drain_timeout_s"] = "every process drains for the top-level drain_timeout_s"


def refuse_launcher_settings(
    values: dict[str, Any], where: str = "", also: dict[str, dict[str, str]] | None = None
) -> None:
    """A deployment file's role sections must not hold what the launcher sets itself
    (``also``: a launcher's own, by role)."""
    for role, owned in LAUNCHER_SETS.items():
        owned = {**owned, **(also or {}).get(role, {})}
        given = values.get(role)
        for name in sorted(set(given) & set(owned)) if isinstance(given, dict) else ():
            raise ConfigError(f"{role}.{name} cannot be set in a deployment's config: "
                              f"{owned[name]}{' (in ' + where + ')' if where else ''}")  # fmt: skip


def router_context(router: int | None, engine: int | None) -> int | None:
    """The router's ``max_model_len`` in a deployment: its own, within the workers'."""
    given = [n for n in (router, engine) if n is not None]
    return min(given) if given else None


def save_yaml(path: str | Path, config: Any) -> None:
    """Write a config dataclass as YAML that ``role_config`` reads back."""
    import yaml

    data = dataclasses.asdict(config)
    Path(path).write_text(yaml.safe_dump(_plain(data), sort_keys=False))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
