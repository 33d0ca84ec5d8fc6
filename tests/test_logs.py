"""Process logging: the request id on every line logged for a request; JSON lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from tandem import logs
from tandem.errors import ConfigError


@pytest.fixture
def captured():
    """A buffer for configure() to write into; the root logger restored afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield io.StringIO()
    root.handlers[:], root.level = saved[0], saved[1]


async def _handler(rid: str) -> None:
    logs.request_id.set(rid)  # as the gRPC handlers do
    await asyncio.sleep(0)
    logging.getLogger("tandem.router").info("placed on %s", "w1")


def test_text_lines_carry_the_id_of_the_request_whose_task_logged_them(captured):
    logs.configure("router", fmt="text", stream=captured)

    async def both():
        await asyncio.gather(_handler("a"), _handler("b"))
        logging.getLogger("tandem.router").info("not about a request")

    asyncio.run(both())
    lines = captured.getvalue().splitlines()
    assert len(lines) == 3
    assert sorted(line.split("tandem.router")[1] for line in lines[:2]) == [
        " [request=a]: placed on w1", " [request=b]: placed on w1"]  # fmt: skip
    assert lines[2].startswith("tandem router ") and lines[2].endswith(
        "tandem.router: not about a request"
    )


def test_json_lines_are_one_object_each_with_the_request_id_and_traceback(captured):
    logs.configure("decode", fmt="json", stream=captured)
    asyncio.run(_handler("r-7"))
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("tandem.engine").exception("step failed")
    first, second = (json.loads(line) for line in captured.getvalue().splitlines())
    assert first["request_id"] == "r-7" and first["message"] == "placed on w1"
    assert (first["process"], first["level"], first["logger"]) == ("decode", "INFO",
                                                                   "tandem.router")  # fmt: skip
    assert "request_id" not in second and "ValueError: boom" in second["exception"]


def test_the_format_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch, captured):
    monkeypatch.setenv(logs.ENV, "json")
    assert logs.log_format() == "json"
    monkeypatch.setenv(logs.ENV, "xml")
    with pytest.raises(ConfigError, match="TANDEM_LOG_FORMAT"):
        logs.configure("router", stream=captured)


def test_the_tandem_command_writes_json_lines_too_when_asked():
    # Its own lines (a launcher's "decode-0 exited ...", a command's error) stayed text.
    import os
    import subprocess
    import sys

    env = {**os.environ, logs.ENV: "json"}
    for args, code in ((["--max-tokens", "2", "hello"], 0), (["--model", "nosuch", "x"], 2)):
        run = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "generate", "--colocated", "--model",
             "tiny-random", *args], env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == code, run.stderr
        lines = run.stderr.splitlines()
        assert lines and all(json.loads(line)["process"] == "tandem" for line in lines), lines


@pytest.mark.parametrize("module", ["tandem.decode_worker", "tandem.router"])
def test_a_process_that_cannot_start_says_why_in_json_when_asked(module):
    # A worker's or router's last word ("tandem: error: ...", its traceback) was text
    # in a JSON log.
    import os
    import subprocess
    import sys

    env = {**os.environ, logs.ENV: "json"}
    run = subprocess.run([sys.executable, "-m", module, "--model", "/nonexistent/m.gguf"],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stderr
    records = [json.loads(line) for line in run.stderr.splitlines()]
    assert records[-1]["level"] == "ERROR"
    assert "/nonexistent/m.gguf" in records[-1]["message"]
