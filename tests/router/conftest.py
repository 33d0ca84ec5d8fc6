"""The router's frontend (tiny-random tokenizer and limits), loaded once per session."""

from __future__ import annotations

import pytest

from tandem.config import RouterConfig
from tandem.router.frontend import Frontend


@pytest.fixture(scope="session")
def frontend() -> Frontend:
    return Frontend.load(RouterConfig(model="tiny-random"))
