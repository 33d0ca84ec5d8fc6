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


def test_max_tokens_goes_unset_unless_given_as_the_router_caps_its_default(fake, capsys):
    # Always sent as 256: a prompt near the context's end was refused where the router
    # stops an unset max_tokens at the context's end.
    assert main(["generate", "--router", fake.address, "hi"]) == 0
    assert main(["generate", "--router", fake.address, "--max-tokens", "7", "hi"]) == 0
    first, second = fake.servicer.requests
    assert not first.sampling.HasField("max_tokens")
    assert second.sampling.max_tokens == 7


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


@pytest.mark.parametrize(
    "argv, message",
    [(["--router", "127.0.0.1:1", "--model", "m.gguf"],
      "--model is not used with --router: the router's workers run their own engine settings"),
     (["--router", "127.0.0.1:1", "--config", "c.yaml"], "--config is not used with --router"),
     (["--colocated", "--api-key-file", "key"],
      "--api-key-file is not used with --colocated: --colocated connects to no router"),
     (["--colocated", "--model", "tiny-random", "--kv-sinks", "8"],
      "--kv-sinks is used only with a KV window")],
)  # fmt: skip
def test_a_flag_the_chosen_mode_would_ignore_is_refused(capsys, argv, message):
    assert main(["generate", *argv, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem: error: {message}") and err.count("\n") == 1, err
