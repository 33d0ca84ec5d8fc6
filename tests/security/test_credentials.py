"""Cluster credentials: the throw-away set, an operator's files, and the loopback rule."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest
from cryptography import x509

from tandem.config import ClusterSecurityConfig, DecodeConfig, PrefillConfig
from tandem.decode_worker import DecodeServer
from tandem.errors import ConfigError
from tandem.prefill_worker import PrefillServer
from tandem.security import pki
from tandem.security.cluster import ClusterCredentials
from tandem.security.tls import is_loopback
from tests.workers import BackgroundLoop, engine_config, start_worker, stop_worker


def test_a_throw_away_set_is_written_owner_only_and_reads_back_equal(tmp_path):
    creds = ClusterCredentials.create()
    config = creds.write(tmp_path / "cluster")
    assert stat.S_IMODE((tmp_path / "cluster").stat().st_mode) == 0o700
    for path in (config.ca_file, config.cert_file, config.key_file, config.kv_secret_file):
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600, path
    assert ClusterCredentials.load(config) == creds
    assert "PRIVATE" not in repr(creds) and creds.kv_secret.decode() not in repr(creds)


def test_writing_over_loose_files_or_symlinks_leaves_owner_only_files(tmp_path):
    # A run dir written before (or by hand): a file keeps its mode through
    # open(O_CREAT, 0o600), and a symlink would be followed.
    directory = tmp_path / "cluster"
    directory.mkdir()
    (directory / "member-key.pem").write_text("old")
    (directory / "member-key.pem").chmod(0o644)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not a secret")
    (directory / "kv-secret").symlink_to(elsewhere)
    creds = ClusterCredentials.create()
    config = creds.write(directory)
    for path in (config.ca_file, config.cert_file, config.key_file, config.kv_secret_file):
        assert stat.S_IMODE(Path(path).lstat().st_mode) == 0o600, path
    assert elsewhere.read_text() == "not a secret"
    assert ClusterCredentials.load(config) == creds
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["ca.pem", "member.pem", "member-key.pem", "kv-secret"]
    )  # no temporary file left


def test_the_member_certificate_chains_to_the_ca_and_names_the_cluster():
    creds = ClusterCredentials.create()
    ca = x509.load_pem_x509_certificate(creds.ca)
    member = x509.load_pem_x509_certificate(creds.cert)
    member.verify_directly_issued_by(ca)
    names = member.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert pki.CLUSTER_SERVER_NAME in names.get_values_for_type(x509.DNSName)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 0
    assert ClusterCredentials.create().kv_secret != creds.kv_secret


def test_no_files_means_none_and_some_files_name_the_missing_ones(tmp_path):
    assert ClusterCredentials.load(ClusterSecurityConfig()) is None
    config = ClusterCredentials.create().write(tmp_path)
    with pytest.raises(ConfigError, match="cluster.key_file, cluster.kv_secret_file missing"):
        ClusterCredentials.load(dataclasses.replace(config, key_file="", kv_secret_file=""))
    with pytest.raises(ConfigError, match="cluster.ca_file: cannot read /nonexistent"):
        ClusterCredentials.load(dataclasses.replace(config, ca_file="/nonexistent"))
    (tmp_path / "short").write_bytes(b"too short")
    with pytest.raises(ConfigError, match="at least 16 bytes, got 9"):
        ClusterCredentials.load(dataclasses.replace(config, kv_secret_file=str(tmp_path / "short")))


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
     ("example.com", False)],
)  # fmt: skip
def test_loopback_is_only_what_no_other_machine_reaches(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("server_cls", "config_cls"), [(PrefillServer, PrefillConfig), (DecodeServer, DecodeConfig)]
)
def test_a_worker_off_loopback_without_credentials_refuses_to_start(server_cls, config_cls):
    bg = BackgroundLoop()
    try:
        server = server_cls(config_cls(engine=engine_config(), host="0.0.0.0"))
        with pytest.raises(ConfigError, match="cluster.insecure: true") as err:
            bg.run(server.start())
        assert "anyone who reaches it" in str(err.value)
        assert server.engine is None  # refused before loading anything
    finally:
        bg.close()


def test_an_insecure_worker_may_bind_every_interface():
    bg = BackgroundLoop()
    config = PrefillConfig(
        engine=engine_config(), host="0.0.0.0", kv_backend="inproc",
        cluster=ClusterSecurityConfig(insecure=True),
    )  # fmt: skip
    worker = start_worker(bg, config)
    try:
        assert worker.server.port and worker.server.credentials is None
    finally:
        stop_worker(bg, worker)
        bg.close()
