#!/usr/bin/env bash
# Join a node to a hand-made Tandem cluster as a prefill or a decode node.
#
# Each Tandem worker asks for one unit of its pool's resource, so the node takes
# only that pool's workers, at most SLOTS of them. The node authenticates with the
# token start-head.sh made (copy that file here first).
set -euo pipefail

usage() {
  cat >&2 <<USAGE
usage: $0 --address HEAD:PORT [options] prefill|decode [SLOTS] [-- extra ray start arguments]
  SLOTS                     workers of the pool this node may host
                            (default: its GPU count, or 1 on a CPU-only node)
  --address HEAD:PORT       the head's address (as start-head.sh printed it)
  --token-file FILE         the cluster's token, copied from the head
                            (default \$TANDEM_RAY_TOKEN_FILE or ~/.tandem/ray-cluster.token)
  --node-ip IP              this node's address as the others reach it (default: Ray's guess)
  --num-cpus N              logical CPUs Ray may hand out here (default: all)
  --object-store-memory B   object store bytes (default 268435456)
  --temp-dir DIR            Ray's logs and sockets; one per node when several share a
                            machine, and short (default /tmp/ray)
USAGE
  exit 2
}

head="" node_ip="" num_cpus="" store=268435456 temp_dir=""
token_file="${TANDEM_RAY_TOKEN_FILE:-$HOME/.tandem/ray-cluster.token}"
positional=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --address) head="$2"; shift 2 ;;
    --token-file) token_file="$2"; shift 2 ;;
    --node-ip) node_ip="$2"; shift 2 ;;
    --num-cpus) num_cpus="$2"; shift 2 ;;
    --object-store-memory) store="$2"; shift 2 ;;
    --temp-dir) temp_dir="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    -*) echo "$0: unknown option $1" >&2; usage ;;
    *) positional+=("$1"); shift ;;
  esac
done
# The former form, `start-worker.sh HEAD:PORT prefill|decode [SLOTS]`, still works.
if [[ -z "$head" && ${#positional[@]} -ge 2 && "${positional[0]}" == *:* ]]; then
  head="${positional[0]}"; positional=("${positional[@]:1}")
fi
pool="${positional[0]:-}"
if [[ -z "$head" || ( "$pool" != prefill && "$pool" != decode ) || ${#positional[@]} -gt 2 ]]; then
  usage
fi
if [[ ! -s "$token_file" ]]; then
  echo "$0: no token at $token_file; copy the head's token file here (--token-file)" >&2
  exit 1
fi
gpus="$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)"
slots="${positional[1]:-$(( gpus > 0 ? gpus : 1 ))}"

export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$token_file"
unset RAY_AUTH_TOKEN

free_port() { "${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
args=(--address="$head" --disable-usage-stats --object-store-memory="$store"
      --resources="{\"$pool\": $slots}" --dashboard-agent-listen-port="$(free_port)")
[[ -z "$node_ip" ]] || args+=(--node-ip-address="$node_ip")
[[ -z "$num_cpus" ]] || args+=(--num-cpus="$num_cpus")
[[ -z "$temp_dir" ]] || args+=(--temp-dir="$temp_dir")

echo "joining $head as a $pool node ($slots slot(s)), token $token_file"
ray start "${args[@]}" "$@"
