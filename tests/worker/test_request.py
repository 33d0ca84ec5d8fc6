"""parse_request: a WorkerRequest off the wire is checked before any KV block is taken."""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidRequestError
from tandem.wire import worker_request
from tandem.worker.request import parse_request

PARAMS = SamplingParams(max_tokens=5, temperature=0)


def test_earlier_output_reaches_the_work_request(tiny_engine):
    req = parse_request(worker_request("r", [1, 2, 3], PARAMS, [7, 8, 9, 10]), tiny_engine)
    assert (req.request_id, req.prompt_ids, req.output_ids) == ("r", [1, 2, 3], [7, 8, 9, 10])
    assert parse_request(worker_request("r", [1, 2, 3], PARAMS), tiny_engine).output_ids == []


@pytest.mark.parametrize(
    ("output_ids", "message"),
    [
        ([7] * 5, "output_token_ids must be fewer than max_tokens (5), got 5"),
        ([7] * 6, "output_token_ids must be fewer than max_tokens (5), got 6"),
        ([7, 259], "output token id 259 is outside [0, 259)"),
    ],
)
def test_bad_earlier_output_names_the_field_and_the_limit(tiny_engine, output_ids, message):
    with pytest.raises(InvalidRequestError) as err:
        parse_request(worker_request("r", [1, 2, 3], PARAMS, output_ids), tiny_engine)
    assert err.value.field == "output_token_ids" and str(err.value) == message
