"""The kernel tests run the Triton backend on CPU through Triton's interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py before anything can import triton)."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_backend_or_skip():
    """The triton backend module, or a skip that says why it cannot run here."""
    if not TRITON_INSTALLED:
        pytest.skip("triton is not installed")
    from tandem.kernels import triton as backend

    if not backend.INTERPRET and not torch.cuda.is_available():
        pytest.skip("tandem.kernels.triton was imported without TRITON_INTERPRET=1 and no CUDA")
    return backend


def cpu_backend_or_skip():
    """The cpu backend module, loaded; a skip only where there is no C compiler (a
    compiler that fails to build the kernels fails the test)."""
    from tandem.kernels import cpu
    from tandem.kernels.cpu.build import compiler

    if shutil.which(compiler()[0]) is None:
        pytest.skip(f"no C compiler {compiler()[0]!r} to build the cpu backend's kernels")

    assert cpu.load(), "the cpu backend's kernels did not build: see the log"
    return cpu


BACKEND_NAMES = ("torch", "cpu", "triton")


@pytest.fixture(params=BACKEND_NAMES)
def backend(request: pytest.FixtureRequest):
    """Each attention backend that can run here (triton interpreted on CPU)."""
    if request.param == "triton":
        triton_backend_or_skip()
    if request.param == "cpu":
        cpu_backend_or_skip()
    from tandem.kernels import get_backend

    return get_backend(request.param)


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for the module: on tiny tensors extra threads only add
    synchronisation, which costs tens of milliseconds per op when the cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
