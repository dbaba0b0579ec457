#!/usr/bin/env bash
# Multi-node training without a cluster: two torchrun agents, each standing in for one node,
# meet at a c10d rendezvous on 127.0.0.1, exactly as two machines would meet at HOST:PORT.
#
#   bash 04_multinode/run_two_nodes.sh [total_epochs] [save_every] [--batch_size N ...]
#
# NPROC sets the processes per "node" (default 2), PORT the rendezvous port (default 29603).
# Both agents run in this directory, so they share snapshot.pt as nodes share a filesystem.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nproc="${NPROC:-2}"
port="${PORT:-29603}"

pids=()
for node in 0 1; do
  (
    set -o pipefail
    torchrun --nnodes=2 --nproc_per_node="$nproc" --rdzv-id="two-nodes-$port" \
      --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:$port" "$here/train.py" "$@" 2>&1 |
      sed -u "s/^/[agent $node] /"
  ) &
  pids+=("$!")
done

status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
exit "$status"
