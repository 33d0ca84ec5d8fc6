"""Tandem's UCX environment defaults: filled in where unset, never over an operator's."""

from __future__ import annotations

from tandem.kv_transfer.ucx.runtime import ucx_env_defaults


def test_defaults_fill_an_empty_environment():
    env = ucx_env_defaults({})
    assert env == {
        "UCX_TLS": "tcp,sm,self",
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        "UCX_MM_ERROR_HANDLING": "y",  # shared memory under peer-failure error handling
    }


def test_without_tls_the_transports_are_left_to_ucx():
    assert "UCX_TLS" not in ucx_env_defaults({}, tls=None)


def test_an_operators_transports_win():
    env = {"UCX_TLS": "rc,ud,sm,self", "PATH": "/bin"}
    assert ucx_env_defaults(env) is env
    assert env["UCX_TLS"] == "rc,ud,sm,self" and env["PATH"] == "/bin"
    assert env["UCX_WARN_UNUSED_ENV_VARS"] == "n"
