"""``tandem generate --router``: what it prints and its exit code, against a scripted router."""

from __future__ import annotations

import pytest

from tandem._proto.tandem.v1 import tandem_pb2
from tandem.cli import main
from tests.client.fake_router import FakeServer


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.stop()


def test_a_generation_streams_its_text_and_exits_0(fake, capsys):
    assert main(["generate", "--router", fake.address, "hi"]) == 0
    assert capsys.readouterr().out == "Hello\n"


def test_a_generation_a_worker_failed_exits_non_zero(fake, capsys):
    # A decode worker whose engine step failed ends the stream with finish_reason
    # "error" (status OK): the text so far is printed, but it is not a success.
    fake.servicer.finish_reason = tandem_pb2.FINISH_REASON_ERROR
    assert main(["generate", "--router", fake.address, "hi"]) == 2
    out, err = capsys.readouterr()
    assert out == "Hello\n"
    assert err.splitlines()[-1] == "tandem: error: the generation failed after 3 tokens"


def test_a_stream_without_its_final_response_is_an_error_not_a_traceback(fake, capsys):
    fake.servicer.final = False
    assert main(["generate", "--router", fake.address, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "tandem: error: INTERNAL: the stream ended without a final response"
    )
