from __future__ import annotations

import pytest

from tests.client.fake_router import FakeServer


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.stop()
