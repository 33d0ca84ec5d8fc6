"""Admission: a hard bound on requests in flight, released however a request ends."""

from __future__ import annotations

import grpc
import pytest

from tandem.router.admission import Admission
from tandem.router.errors import RouterError


def test_admits_up_to_the_bound_then_refuses_at_once():
    admission = Admission(2)
    with admission.admit(), admission.admit():
        assert admission.in_flight == 2
        with pytest.raises(RouterError) as info, admission.admit():
            pass
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queue=2" in info.value.message
        assert admission.in_flight == 2
    assert admission.in_flight == 0


def test_a_failed_request_gives_its_slot_back():
    admission = Admission(1)
    with pytest.raises(KeyError), admission.admit():
        raise KeyError("boom")
    assert admission.in_flight == 0
    with admission.admit():
        assert admission.in_flight == 1
