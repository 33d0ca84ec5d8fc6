"""dtype: auto picks bfloat16 where the CPU computes in it natively, float32 elsewhere;
a device that Tandem cannot run on is refused by name."""

from __future__ import annotations

import platform

import pytest
import torch

from tandem.engine import device
from tandem.engine.device import native_bf16_in, resolve_device, resolve_dtype
from tandem.errors import ConfigError

# Abridged /proc/cpuinfo texts: the flags lines are those of the named CPUs.
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma bmi2 sha_ni vaes vpclmulqdq
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
ICE_LAKE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8375C
flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bitalg
"""


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        (ZEN3, False),
        (SAPPHIRE_RAPIDS, True),
        (ICE_LAKE, False),
        ("", False),
        ("flags: avx512_bf16x\n", False),
    ],  # fmt: skip
)
def test_native_bf16_is_read_from_the_flags(cpuinfo, native):
    assert native_bf16_in(cpuinfo) is native


@pytest.mark.parametrize(("native", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_follows_the_cpu_and_explicit_dtypes_win(monkeypatch, native, dtype):
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) is dtype
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16


def test_no_cpuinfo_means_float32(tmp_path):
    assert device.cpu_has_native_bf16.__wrapped__(tmp_path / "missing") is False
    (tmp_path / "cpuinfo").write_text(SAPPHIRE_RAPIDS)
    assert device.cpu_has_native_bf16.__wrapped__(tmp_path / "cpuinfo") is True


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_engines_malloc_thresholds():
    assert device.keep_step_buffers_mapped()


@pytest.mark.parametrize("name", ["mps", "xpu", "meta"])
def test_a_device_type_tandem_does_not_run_on_is_refused_by_name(name):
    # mps got as far as the model's load and failed there with a traceback.
    with pytest.raises(ConfigError, match=f"device '{name}' is not supported"):
        resolve_device(name)


def test_a_cuda_device_needs_a_gpu_for_each_tensor_parallel_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda", gpus=2) == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"'cuda:1' needs GPUs 1\.\.2 .* this host has 2"):
        resolve_device("cuda:1", gpus=2)
    with pytest.raises(ConfigError, match="'cuda:2' needs GPU 2"):
        resolve_device("cuda:2")
    # auto (the default) is checked as cuda is: it took cuda:1 on a 1-GPU host, and
    # rank 1 failed to start once rank 0 had loaded its shard.
    assert resolve_device("auto", gpus=2) == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"'cuda' needs GPUs 0\.\.2 .* this host has 2"):
        resolve_device("auto", gpus=3)
