"""Shared fixtures: engines are expensive, so each model is loaded once per session;
test certificates (pki, ~50 ms each) are made once too.

Triton kernels run under Triton's interpreter in the tests (tests/kernels):
``@triton.jit`` and Triton's settings read TRITON_INTERPRET when they are first
imported, and a test module may import triton indirectly at collection
(transformers' model classes do), so it is set here, before anything else. A value
already in the environment wins.

The processes that tests start find the ``tests`` package through PYTHONPATH: the
launcher starts its children with PYTHONSAFEPATH, so not through the working
directory, and the launcher's tests start stand-ins from ``tests.deploy``.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).resolve().parent.parent),
     *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)  # fmt: skip

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.security import pki  # noqa: E402


def make_engine(model: str = "tiny-random", **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", **overrides))


@pytest.fixture(scope="session")
def tiny_engine() -> LLMEngine:
    return make_engine("tiny-random")


@pytest.fixture(scope="session")
def tiny_hf(tiny_engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_engine.model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_engine() -> LLMEngine:
    return make_engine("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smol_hf(smol_engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_engine.model_dir, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def _engines_leak_nothing(request):
    """Every test that used an engine must leave its pool intact and empty."""
    yield
    for name in ("tiny_engine", "smol_engine"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            assert not engine.has_unfinished(), "a request was left running"
            engine.kv.pool.check_integrity()
            assert engine.kv.pool.num_used == 0, f"{engine.kv.pool.num_used} KV blocks leaked"


@pytest.fixture(autouse=True)
def _no_api_keys_from_the_environment(monkeypatch):
    """A developer's own TANDEM_API_KEYS would lock every test router, and TANDEM_API_KEY
    would be sent by every test client: tests that want keys set them themselves."""
    monkeypatch.delenv("TANDEM_API_KEYS", raising=False)
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)


@dataclass(frozen=True)
class Certs:
    """PEM files: a CA, the router's certificate (127.0.0.1, localhost) and a client's,
    both signed by it, and a second CA that signed neither."""

    ca: str
    router_cert: str
    router_key: str
    client_cert: str
    client_key: str
    other_ca: str
    other_client_cert: str  # signed by other_ca
    other_client_key: str


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    d: Path = tmp_path_factory.mktemp("pki")
    ca, other = pki.make_ca("test CA"), pki.make_ca("another CA")
    router = pki.issue(ca, "router", dns_names=("localhost",), ip_addresses=("127.0.0.1",))
    client = pki.issue(ca, "client")
    stranger = pki.issue(other, "stranger")
    files = {
        "ca": ca.cert, "router_cert": router.cert, "router_key": router.key,
        "client_cert": client.cert, "client_key": client.key, "other_ca": other.cert,
        "other_client_cert": stranger.cert, "other_client_key": stranger.key,
    }  # fmt: skip
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return Certs(**{name: str(d / f"{name}.pem") for name in files})


# Clusters of real processes whose timeouts (keepalive, drain, Ray's restarts) assume
# the machine to themselves: `make test` runs these on their own, after the rest of the
# suite, which runs on two pytest-xdist workers (a module's tests on one: --dist loadfile).
EXCLUSIVE = ("tests/e2e/", "tests/deploy/test_ray_")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(EXCLUSIVE):
            item.add_marker(pytest.mark.exclusive)
