#!/usr/bin/env bash
# Join a node to a hand-made Tandem cluster as a prefill or a decode node.
#
#   deploy/start-worker.sh HEAD_ADDRESS prefill|decode [SLOTS]
#
# SLOTS: how many workers of the pool the node may host (default: its GPU count,
# or 1 on a CPU-only node). Each Tandem worker asks for one unit of its pool's
# resource, so the node takes only that pool's workers.
set -euo pipefail
if [[ $# -lt 2 || ( "$2" != prefill && "$2" != decode ) ]]; then
  echo "usage: $0 HEAD_ADDRESS prefill|decode [SLOTS]" >&2
  exit 2
fi
head="$1" pool="$2"
gpus="$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)"
slots="${3:-$(( gpus > 0 ? gpus : 1 ))}"
ray start --address="$head" --disable-usage-stats --resources="{\"$pool\": $slots}"
