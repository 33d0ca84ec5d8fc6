"""EngineConfig validation and YAML loading: every bad setting is named in the error."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tandem.config import EngineConfig, from_dict, load_yaml
from tandem.errors import ConfigError

# ---- EngineConfig -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"block_size": 3}, "block_size must be a power of two >= 1, got 3"),
        ({"block_size": 0}, "block_size must be a power of two >= 1, got 0"),
        ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes must be >= 1, got 0"),
        (
            {"dtype": "float64"},
            "dtype must be one of auto, float32, bfloat16, float16, got 'float64'",
        ),
        ({"max_model_len": 1}, "max_model_len must be >= 2, got 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
        ({"num_threads": 0}, "num_threads must be >= 1, got 0"),
        (
            {"attention_backend": "cuda"},
            "attention_backend must be one of auto, torch, cpu, triton, got 'cuda'",
        ),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, int8, got 'fp8'"),
        ({"int4_max_rows": -1}, "int4_max_rows must be >= 0 (0: never), got -1"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_engine_config_names_the_bad_setting(overrides, message):
    with pytest.raises(ConfigError) as err:
        EngineConfig(**overrides)
    assert str(err.value) == message


def test_engine_config_accepts_the_limits():
    config = EngineConfig(block_size=1, num_blocks=1, max_model_len=2, max_num_seqs=1)
    assert (config.block_size, config.num_blocks, config.max_model_len) == (1, 1, 2)


def test_from_dict_lists_unknown_keys_and_the_file():
    with pytest.raises(ConfigError) as err:
        from_dict(EngineConfig, {"block_size": 32, "blocksize": 32, "gpu": 1}, where="a.yaml")
    known = ", ".join(sorted(f.name for f in dataclasses.fields(EngineConfig)))
    assert str(err.value) == f"unknown settings blocksize, gpu in a.yaml (known: {known})"


def test_from_dict_names_a_single_unknown_key_without_a_file():
    with pytest.raises(ConfigError) as err:
        from_dict(EngineConfig, {"gpu": 1})
    assert str(err.value).startswith("unknown setting gpu (known: attention_backend, ")


def test_from_dict_builds_the_config():
    config = from_dict(EngineConfig, {"model": "tiny-random", "block_size": 32})
    assert config == EngineConfig(model="tiny-random", block_size=32)


def test_load_yaml(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("engine:\n  block_size: 32\n")
    assert load_yaml(good) == {"engine": {"block_size": 32}}
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    with pytest.raises(ConfigError, match=r"^config .*list\.yaml must be a mapping"):
        load_yaml(listed)
    with pytest.raises(ConfigError, match=r"^cannot read config .*missing\.yaml: "):
        load_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [  # YAML keeps the last of a key given twice: the first section's keys file was gone
        ("router:\n  api_keys_file: keys.txt\nnum_decode: 2\nrouter:\n  max_queue: 64\n",
         r":4: router is set twice \(first on line 1\)$"),
        ("engine:\n  block_size: 16\n  block_size: 32\n", r":3: block_size is set twice"),
        ("router:\n  on: 1\n", r":2: a setting's name must be a string, got True \(bool\)"),
        ("1: 2\n", r":1: a setting's name must be a string, got 1 \(int\)"),
        ("[]\n", r"must be a mapping at the top level, got list$"),
        ("false\n", r"must be a mapping at the top level, got bool$"),
        ("# r\xe9glages\n".encode("latin-1"), r"^cannot read config .*'utf-8' codec"),
    ],
    ids=["section-twice", "key-twice", "yaml-on", "number", "list", "false", "latin-1"],
)  # fmt: skip
def test_load_yaml_refuses_what_yaml_would_read_otherwise(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=message):
        load_yaml(path)


def test_load_yaml_lets_a_merged_mapping_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "base: &b {block_size: 16, num_blocks: 8}\nengine:\n  <<: *b\n  block_size: 32\n"
    )
    assert load_yaml(path)["engine"] == {"block_size": 32, "num_blocks": 8}
    (tmp_path / "empty.yaml").write_text("# nothing set\n")
    assert load_yaml(tmp_path / "empty.yaml") == {}


@pytest.mark.parametrize(
    ("field", "value"),
    [("worker_keepalive_s", float("inf")), ("worker_keepalive_s", 3e6),
     ("worker_keepalive_timeout_s", float("nan")), ("max_request_bytes", 2**31)],
)  # fmt: skip
def test_router_values_that_grpc_cannot_take_are_refused_by_name(field, value):
    # They passed, and the router died at start with OverflowError, its workers loaded.
    from tandem.config import RouterConfig

    with pytest.raises(ConfigError, match=rf"^{field} must be .*, got {value}"):
        RouterConfig(**{field: value})


@pytest.mark.parametrize(
    ("ports", "message"),
    [({"port": 8000, "http_port": 8000}, "http_port and port are both 8000"),
     ({"port": 8000, "metrics_port": 8000}, "metrics_port and port are both 8000"),
     ({"http_port": 9400, "metrics_port": 9400}, "metrics_port and http_port are both 9400")],
)  # fmt: skip
def test_the_routers_listeners_need_ports_of_their_own(ports, message):
    # The clash showed only once the workers had loaded, as the router failed to bind.
    from tandem.config import RouterConfig

    with pytest.raises(ConfigError, match=f"^{message}: one listener each$"):
        RouterConfig(**ports)
    RouterConfig(port=0, http_port=0, metrics_port=0)  # any free port: no clash


def test_role_configs_round_trip_through_yaml(tmp_path):
    from tandem.config import DecodeConfig, RouterConfig, role_config, save_yaml

    decode = DecodeConfig(engine=EngineConfig(model="tiny-random", num_blocks=7), kv_lease_s=3.0)
    router = RouterConfig(prefill_workers=("127.0.0.1:1",), decode_workers=("127.0.0.1:2",))
    for config in (decode, router):
        path = tmp_path / f"{type(config).__name__}.yaml"
        save_yaml(path, config)
        assert role_config(type(config), load_yaml(path), where=str(path)) == config


def test_role_config_names_bad_engine_settings():
    from tandem.config import PrefillConfig, role_config

    with pytest.raises(ConfigError, match="unknown setting blocks in f.yaml"):
        role_config(PrefillConfig, {"engine": {"blocks": 3}}, where="f.yaml")


@pytest.mark.parametrize(
    "field", ["worker_keepalive_s", "worker_keepalive_timeout_s", "status_interval_s"]
)
def test_router_intervals_must_be_positive(field):
    from tandem.config import RouterConfig

    with pytest.raises(ConfigError, match=field):
        RouterConfig(**{field: 0})


@pytest.mark.parametrize(
    "field", ["queue_timeout_s", "prefill_timeout_s", "max_migrations", "prefix_imbalance_max"]
)
def test_router_bounds_must_not_be_negative(field):
    from tandem.config import RouterConfig

    with pytest.raises(ConfigError, match=f"{field} must be >= 0, got -1"):
        RouterConfig(**{field: -1})
    assert getattr(RouterConfig(**{field: 0}), field) == 0  # 0: no bound


@pytest.mark.parametrize("role", ["PrefillConfig", "DecodeConfig"])
def test_a_workers_engine_stall_timeout_must_not_be_negative(role):
    import tandem.config

    cls = getattr(tandem.config, role)
    message = r"engine_stall_timeout_s must be >= 0 \(0: off\), got -1"
    with pytest.raises(ConfigError, match=message):
        cls(engine_stall_timeout_s=-1)
    assert cls(engine_stall_timeout_s=0).engine_stall_timeout_s == 0  # no watchdog


@pytest.mark.parametrize(
    "values, message",
    [
        # A quoted boolean is a non-empty string, which Python takes as true.
        ({"insecure": "false"}, "insecure must be true or false, got 'false' (str)"),
        ({"port": 50051.9}, "port must be a whole number, got 50051.9 (float)"),
        ({"max_queue": True}, "max_queue must be a whole number, got True (bool)"),
        ({"queue_timeout_s": "5"}, "queue_timeout_s must be a finite number, got '5' (str)"),
        # YAML's .nan passed every "< 0" check: a wait of nan seconds never ends; and
        # .inf every "> 0" one.
        ({"drain_timeout_s": float("nan")}, "drain_timeout_s must be a finite number, got nan"),
        ({"status_interval_s": float("inf")}, "status_interval_s must be a finite number, got inf"),
        ({"max_model_len": "4k"}, "max_model_len must be a whole number or null, got '4k'"),
        ({"decode_workers": "10.0.0.1:5000"}, "decode_workers must be a list of strings"),
        ({"decode_workers": ["a:1", 2]}, "decode_workers must be a list of strings"),
        ({"disaggregation": "conditional"}, "disaggregation must be a mapping of settings"),
        (
            {"cluster": {"insecure": "no"}},
            "insecure must be true or false, got 'no' (str) (in router.yaml cluster)",
        ),
    ],
)
def test_settings_of_the_wrong_type_are_refused_by_name(values, message):
    from tandem.config import RouterConfig, role_config

    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        role_config(RouterConfig, values, "router.yaml")


@pytest.mark.parametrize(
    "address, message",
    [("127.0.0.1:99999", "the port must be a number in [1, 65535], got '99999'"),
     ("[::1]:0", "the port must be a number in [1, 65535], got '0'"),
     ("10.0.0.1:", "the port must be a number in [1, 65535], got ''"),
     ("10.0.0.1", "has no port (host:port or [v6]:port)"),
     ("[::1]5", "is not host:port or [v6]:port")],
)  # fmt: skip
@pytest.mark.parametrize("field", ["prefill_workers", "decode_workers"])
def test_a_worker_address_whose_port_grpc_would_wrap_is_refused(field, address, message):
    """The router dialled 99999 mod 65536 = 34463 and reported ready."""
    from tandem.config import RouterConfig

    with pytest.raises(ConfigError) as err:
        RouterConfig(**{field: (address,)})
    assert str(err.value) == f"{field} {address!r} {message}".replace("' the", "': the")
    assert RouterConfig(**{field: ("[::1]:65535", "h:1")})


def test_numbers_and_empty_sections_take_their_natural_yaml_forms():
    from tandem.config import RouterConfig, role_config

    values = {"queue_timeout_s": 5, "max_model_len": None, "decode_workers": ["a:1"],
              "disaggregation": None}  # fmt: skip
    config = role_config(RouterConfig, values)
    assert config.queue_timeout_s == 5 and config.decode_workers == ("a:1",)


@pytest.mark.parametrize(
    "values, message",
    [({"prefill": {"engine": {"max_num_batched_tokens": 4096}}},
      "prefill.engine cannot be set in a deployment's config: every worker takes the "
      "top-level engine: section (in c.yaml)"),
     ({"decode": {"kv_port": 7000}}, "decode.kv_port cannot be set"),
     ({"router": {"model": "other"}}, "router.model cannot be set"),
     ({"router": {"decode_workers": ["a:1"]}}, "router.decode_workers cannot be set"),
     ({"decode": {"drain_timeout_s": 120}}, "decode.drain_timeout_s cannot be set"),
     # The in-process backend in separate processes: the cluster served, then failed
     # every request (INVALID_ARGUMENT where only one pool had it).
     ({"decode": {"kv_backend": "inproc"}}, "decode.kv_backend cannot be set"),
     # One id for every worker of the pool: their metrics merged.
     ({"prefill": {"worker_id": "p"}}, "prefill.worker_id cannot be set")],
)  # fmt: skip
def test_a_deployment_refuses_what_its_launcher_sets_for_every_process(values, message):
    # Each would be replaced by the launcher without a word (a pool's engine tuning).
    from tandem.deploy.local import cluster_config
    from tandem.deploy.ray_cluster.config import deploy_config

    for build in (cluster_config, deploy_config):
        with pytest.raises(ConfigError, match="^" + re.escape(message)):
            build(values, "c.yaml")


def test_the_routers_context_is_the_workers_when_the_engine_sets_one():
    from tandem.config import router_context

    assert router_context(None, 64) == 64 and router_context(32, 64) == 32
    assert router_context(None, None) is None and router_context(128, None) == 128


@pytest.mark.parametrize(
    "values, message",
    [({"decode": 5}, "decode must be a mapping of settings, got 5 (int)"),
     ({"router": ["a"]}, "router must be a mapping of settings"),
     ({"ray": 3}, "ray must be a mapping of settings"),
     ({"ray": {"prefill": 2}},
      "prefill must be a mapping of settings, got 2 (int) (in r.yaml ray)"),
     ({"ray": {"autoscale": [1]}}, "autoscale must be a mapping of settings"),
     ({"prefill": {"host": "10.1.2.3"}},
      "prefill.host cannot be set in a deployment's config: each worker listens on its node's"),
     ({"router": {"drain_timeout_s": 5}},
      "router.drain_timeout_s cannot be set in a deployment's config: set ray.drain_timeout_s")],
)  # fmt: skip
def test_a_ray_deployment_names_what_is_wrong_with_its_sections(values, message):
    from tandem.deploy.ray_cluster.config import deploy_config

    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        deploy_config(values, "r.yaml")


@pytest.mark.parametrize(
    "values, message",
    [({"startup_timeout_s": 0}, "startup_timeout_s must be finite and > 0, got 0 (in c.yaml)"),
     ({"startup_timeout_s": float("inf")}, "startup_timeout_s must be a finite number, got inf"),
     ({"drain_timeout_s": -1}, "drain_timeout_s must be finite and >= 0, got -1 (in c.yaml)"),
     ({"num_prefill": 2, "prefill": {"metrics_port": 9400}},
      "prefill.metrics_port would be every prefill worker's")],
)  # fmt: skip
def test_a_local_deployment_checks_its_own_settings_when_loaded(values, message):
    # Each was taken: a start that failed "not ready after -1 s" naming no setting, or
    # the second worker failing to bind its metrics port after its model had loaded.
    from tandem.deploy.local import cluster_config

    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        cluster_config(values, "c.yaml")
    cluster_config({"num_prefill": 1, "prefill": {"metrics_port": 9400}})  # one worker: fine
