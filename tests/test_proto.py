"""The checked-in generated code matches proto/ (regenerate with `make proto`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tandem._proto.tandem.v1 import tandem_pb2, worker_pb2

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate(tmp_path)
    assert fresh, "no .proto files found"
    for path in fresh:
        checked_in = ROOT / "tandem" / "_proto" / path.relative_to(tmp_path)
        assert checked_in.exists(), f"{checked_in} is missing: run `make proto`"
        assert checked_in.read_text() == path.read_text(), f"{checked_in} is stale: `make proto`"


def test_unset_sampling_fields_are_distinguishable_from_zero():
    # max_tokens=0 must reach validation (INVALID_ARGUMENT), not become "unset".
    params = tandem_pb2.SamplingParams(max_tokens=0)
    assert params.HasField("max_tokens") and not params.HasField("temperature")
    request = worker_pb2.WorkerRequest(sampling=params)
    assert worker_pb2.WorkerRequest.FromString(request.SerializeToString()) == request
