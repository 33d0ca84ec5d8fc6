"""Mutual TLS inside a cluster that ``tandem serve`` started with its defaults,
checked on the wire: the workers' ports speak TLS with a certificate from the
run's own CA and refuse every caller that lacks the cluster's member certificate."""

from __future__ import annotations

import re
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest
import yaml

from tandem._proto.tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.client import TandemClient
from tandem.security import pki
from tandem.security.cluster import ClusterCredentials
from tandem.security.tls import channel_credentials

NAME = ("grpc.ssl_target_name_override", pki.CLUSTER_SERVER_NAME)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`tandem serve` on tiny-random: (router address, the cluster's credentials'
    directory, {role: worker address}). The operator's own credentials: a run's
    throw-away set leaves the disk once every process has read it."""
    tmp = tmp_path_factory.mktemp("serve")
    own = ClusterCredentials.create().write(tmp / "cluster")
    config = tmp / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "threads_per_worker": 1,
        "engine": {"model": "tiny-random", "num_blocks": 64},
        "router": {"port": 0},
        "log_dir": str(tmp / "logs"),
        "cluster": {name: getattr(own, name)
                    for name in ("ca_file", "cert_file", "key_file", "kv_secret_file")},
    }))  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        match = re.fullmatch(r"tandem: serving tiny-random on (\S+)\n", line)
        assert match, line + (proc.stderr.read() if proc.poll() is not None else "")
        args = [c for p in psutil.Process(proc.pid).children() for c in p.cmdline()]
        run_dir = Path(next(a for a in args if a.endswith("router.yaml"))).parent
        workers = {}
        for role in ("prefill", "decode"):
            log = (run_dir / f"{role}-0.log").read_text()
            workers[role] = re.search(rf"{role} worker (\S+) serving", log).group(1)
        yield match.group(1), tmp, workers
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_router_streams_through_workers_that_speak_mutual_tls(served):
    address, creds_dir, workers = served
    with TandemClient(address, timeout=60) as client:
        done = client.complete("hello", max_tokens=4, ignore_eos=True)
    assert done.usage.completion_tokens == 4
    ca = str(creds_dir / "cluster" / "ca.pem")
    for role, worker in workers.items():
        host, port = worker.rsplit(":", 1)
        context = ssl.create_default_context(cafile=ca)  # verifies chain and name
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname=pki.CLUSTER_SERVER_NAME) as tls:
                cert = tls.getpeercert()
                issuer = dict(x[0] for x in cert["issuer"])
                assert issuer["commonName"] == "Tandem cluster CA", (role, cert)
                # We sent no client certificate: the worker ends the connection.
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                with pytest.raises((ssl.SSLError, ConnectionError)):
                    if not tls.recv(1024):
                        raise ConnectionResetError("closed")


STUBS = {"prefill": worker_pb2_grpc.PrefillWorkerStub, "decode": worker_pb2_grpc.DecodeWorkerStub}


def _status(role: str, address: str, credentials: grpc.ChannelCredentials | None):
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials, options=[NAME])
    with channel:
        try:
            STUBS[role](channel).Status(worker_pb2.StatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_workers_refuse_callers_without_the_cluster_certificate(served):
    _, creds_dir, workers = served
    cluster = creds_dir / "cluster"
    ca = (cluster / "ca.pem").read_bytes()
    stranger_ca = pki.make_ca("someone else's CA")
    stranger = pki.cluster_member(stranger_ca)  # the right name, the wrong CA
    member = channel_credentials(
        ca, (cluster / "member.pem").read_bytes(), (cluster / "member-key.pem").read_bytes()
    )
    for role, address in workers.items():
        assert _status(role, address, None) == grpc.StatusCode.UNAVAILABLE, role  # plaintext
        assert _status(role, address, channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE, role
        foreign = channel_credentials(ca, stranger.cert, stranger.key)
        assert _status(role, address, foreign) == grpc.StatusCode.UNAVAILABLE, role
        assert _status(role, address, member) == grpc.StatusCode.OK, role  # the control


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_prefill_and_decode_refuse_a_caller_without_a_certificate(served, role):
    _, creds_dir, workers = served
    ca = (creds_dir / "cluster" / "ca.pem").read_bytes()
    with grpc.secure_channel(workers[role], channel_credentials(ca), options=[NAME]) as channel:
        if role == "prefill":
            call = worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                worker_pb2.PrefillRequest(), timeout=10
            )
        else:
            call = worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
                worker_pb2.DecodeRequest(), timeout=10
            )
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
