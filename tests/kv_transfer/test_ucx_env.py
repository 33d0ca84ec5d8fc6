"""Tandem's UCX environment defaults: filled in where unset, never over an operator's."""

from __future__ import annotations

from tandem.kv_transfer.ucx.runtime import ucx_env_defaults


def test_defaults_fill_an_empty_environment():
    env = ucx_env_defaults({})
    assert env == {"UCX_TLS": "tcp,sm,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def test_an_operators_transports_win():
    env = {"UCX_TLS": "rc,ud,sm,self", "PATH": "/bin"}
    assert ucx_env_defaults(env) is env
    assert env["UCX_TLS"] == "rc,ud,sm,self" and env["PATH"] == "/bin"
    assert env["UCX_WARN_UNUSED_ENV_VARS"] == "n"
