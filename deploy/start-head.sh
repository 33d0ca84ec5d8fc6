#!/usr/bin/env bash
# Start the Ray head of a hand-made Tandem cluster (no cloud provider). Run it on
# the machine that will host the router; then join nodes with start-worker.sh and
# deploy with `tandem ray up --address ...` (the last lines printed say how).
#
# The head makes the cluster's authentication token (Ray token auth), a file that
# every node and every `tandem` command needs: copy it to them (scp, a secret store).
# The head offers no pool resource, so no Tandem worker is placed on it.
set -euo pipefail

usage() {
  cat >&2 <<USAGE
usage: $0 [options] [-- extra ray start arguments]
  --port PORT               cluster (GCS) port; 0 picks a free one (default 6379)
  --node-ip IP              this node's address as the other nodes reach it
                            (default: the first address of \`hostname -I\`)
  --num-cpus N              logical CPUs Ray may hand out here (default: all)
  --object-store-memory B   object store bytes (default 268435456: Tandem moves KV
                            over UCX, not through Ray's object store)
  --temp-dir DIR            Ray's logs and sockets; one per node when several share a
                            machine, and short (socket paths: ~107 chars) (default /tmp/ray)
  --token-file FILE         the cluster's token, created (mode 600) if missing
                            (default \$TANDEM_RAY_TOKEN_FILE or ~/.tandem/ray-cluster.token)
  --resources JSON          custom resources of the head (default {})
Ports Ray would otherwise fix (dashboard agent, client server) are picked free, so
several nodes can share one machine; pass Ray's own flags after -- to fix them.
USAGE
  exit 2
}

port=6379 node_ip="" num_cpus="" store=268435456 temp_dir="" resources='{}'
token_file="${TANDEM_RAY_TOKEN_FILE:-$HOME/.tandem/ray-cluster.token}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --node-ip) node_ip="$2"; shift 2 ;;
    --num-cpus) num_cpus="$2"; shift 2 ;;
    --object-store-memory) store="$2"; shift 2 ;;
    --temp-dir) temp_dir="$2"; shift 2 ;;
    --token-file) token_file="$2"; shift 2 ;;
    --resources) resources="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "$0: unknown option $1" >&2; usage ;;
  esac
done

free_port() { "${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
[[ -n "$node_ip" ]] || node_ip="$(hostname -I | awk '{print $1}')"
[[ "$port" != 0 ]] || port="$(free_port)"

if [[ ! -s "$token_file" ]]; then
  mkdir -p "$(dirname "$token_file")"
  (umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$token_file")
fi
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$token_file"
unset RAY_AUTH_TOKEN  # Ray would read it before the file

args=(--head --port="$port" --node-ip-address="$node_ip" --disable-usage-stats
      --include-dashboard=false --object-store-memory="$store" --resources="$resources"
      --dashboard-agent-listen-port="$(free_port)" --ray-client-server-port="$(free_port)")
[[ -z "$num_cpus" ]] || args+=(--num-cpus="$num_cpus")
[[ -z "$temp_dir" ]] || args+=(--temp-dir="$temp_dir")

cat <<INFO
Ray head at $node_ip:$port; the cluster's token is $token_file
Copy the token to every node and to where you run tandem, then:
  deploy/start-worker.sh --address $node_ip:$port --token-file TOKEN prefill|decode   # on each node
  tandem ray up --address $node_ip:$port --token-file TOKEN --config deploy/tandem-ray.yaml
INFO
ray start "${args[@]}" "$@"
