#!/usr/bin/env bash
# The multi-node Ray test (tests/deploy/test_ray_multinode.py): a head and three
# worker nodes on this machine, made with start-head.sh / start-worker.sh, then
# node loss and controller loss. Opt-in, since it takes 2 to 6 minutes on two
# cores; `make test` skips it. Run from the repository root after `make setup`.
#
#   deploy/test-multinode.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TANDEM_MULTINODE=1 exec python -m pytest -q tests/deploy/test_ray_multinode.py --durations=0 "$@"
