#!/usr/bin/env bash
# Start the Ray head of a hand-made Tandem cluster (no cloud provider), then
# deploy Tandem on it. Run on the machine that will host the router.
#
#   deploy/start-head.sh [PORT]          # default 6379
#
# The head gets no pool resource, so no worker is placed on it. Afterwards:
#   tandem ray up --address <this host>:PORT --config deploy/tandem-ray.yaml
set -euo pipefail
port="${1:-6379}"
ray start --head --port="$port" --disable-usage-stats --resources='{}'
echo "head started; add nodes with: deploy/start-worker.sh $(hostname -I | awk '{print $1}'):$port prefill|decode"
