from tests.workers import _workers_clean, bg, pair  # noqa: F401
