"""Tandem's UCX environment defaults: filled in where unset, never over an operator's."""

from __future__ import annotations

import torch

from tandem.kv_transfer.ucx.runtime import on_gpu, ucx_env_defaults


def test_defaults_fill_an_empty_environment():
    env = ucx_env_defaults({})
    assert env == {
        "UCX_TLS": "tcp,sm,self",
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        "UCX_MM_ERROR_HANDLING": "y",  # shared memory under peer-failure error handling
        "UCX_LOG_FILE": "stderr",  # where a worker's log is, not stdout
    }


def test_without_tls_the_transports_are_left_to_ucx():
    assert "UCX_TLS" not in ucx_env_defaults({}, tls=None)


def test_an_operators_transports_win():
    env = {"UCX_TLS": "rc,ud,sm,self", "PATH": "/bin"}
    assert ucx_env_defaults(env) is env
    assert env["UCX_TLS"] == "rc,ud,sm,self" and env["PATH"] == "/bin"
    assert env["UCX_WARN_UNUSED_ENV_VARS"] == "n"


def test_a_gpu_worker_adds_the_cuda_transports():
    assert ucx_env_defaults({}, cuda=True)["UCX_TLS"] == "tcp,sm,self,cuda_copy,cuda_ipc"
    assert ucx_env_defaults({"UCX_TLS": "rc,sm"}, cuda=True)["UCX_TLS"] == "rc,sm"


def test_a_gpu_worker_reads_blocks_with_cuda_ipc_gets_without_nvlink():
    # UCX's "auto" turns cuda_ipc gets off without an active NVLink, and a decode
    # worker reads its blocks with gets: they went through the host.
    assert ucx_env_defaults({}, cuda=True)["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    assert ucx_env_defaults({}, tls=None, cuda=True)["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}
    assert ucx_env_defaults(env, cuda=True)["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "auto"
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in ucx_env_defaults({})


def test_which_devices_are_gpus():
    assert not on_gpu("cpu")
    assert on_gpu("cuda") and on_gpu("cuda:1")
    assert on_gpu("auto") == torch.cuda.is_available()
