#!/usr/bin/env bash
# Launch a step of the series on a Slurm cluster: one torchrun agent per node, started by srun,
# meeting at a c10d rendezvous on the first node of the allocation.
#
#   sbatch slurm_scripts/sbatch_run.sh                       # step 04, 50 epochs, save every 10
#   sbatch slurm_scripts/sbatch_run.sh 100 20                # arguments go to train.py
#   STEP=mingpt sbatch slurm_scripts/sbatch_run.sh           # 05_mingpt (hydra overrides as args)
#   NPROC_PER_NODE=2 sbatch --gpus-per-node=0 slurm_scripts/sbatch_run.sh   # CPU nodes, 2 each
#   CONTAINER_IMAGE=$PWD/ddp-series.sqsh sbatch slurm_scripts/sbatch_run.sh  # in the Dockerfile's
#                                                        # image (pyxis/enroot; docs/CONTAINER.md)
#
# Node and GPU counts are set here, once: the #SBATCH lines below. Edit the partition/account
# lines for your cluster. Submit from the repository root (Slurm starts the job in that folder).
#SBATCH --job-name=ddp-series
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun agent per node; it starts the GPU processes
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%j.out
##SBATCH --partition=gpu            # uncomment and edit for your cluster
##SBATCH --account=my-account

set -euo pipefail

# Since Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch: without this each
# torchrun agent (and all its workers) would be pinned to one CPU.
export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"

# The head node: every agent meets there, by the name Slurm knows it by. (`hostname
# --ip-address` can answer 127.0.1.1, which the other nodes cannot reach.) The whole list is
# read into a variable first: a pipe into `head` could break on a long one. Port from the job
# id avoids clashes.
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes%%$'\n'*}
port=$((29500 + SLURM_JOB_ID % 1000))
# One process per GPU Slurm gave this node. NPROC_PER_NODE overrides it where there are none
# (a CPU partition, or slurm_scripts/local_cluster.sh, submitted with --gpus-per-node=0).
nproc_per_node=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-4}}

case "${STEP:-multinode}" in
  multinode) script=04_multinode/train.py ;;
  mingpt)    script=05_mingpt/main.py ;;
  *) echo "error: STEP must be multinode or mingpt, got '$STEP'" >&2; exit 2 ;;
esac

echo "head node: $head_node:$port, nodes: $SLURM_NNODES (${nodes//$'\n'/ }), processes/node: $nproc_per_node"
# Snapshots are written relative to this folder: it must be on storage every node shares.
# --kill-on-bad-exit=1: if one node's agent fails for good, stop the others instead of letting
# them wait at the rendezvous until the time limit.
# CONTAINER_IMAGE: each agent runs in that image (pyxis's srun options), which brings the
# Python environment; this folder is mounted at the same path and is the working directory, so
# the code, the snapshots and the output are the shared folder's, as without a container.
container=()
if [ -n "${CONTAINER_IMAGE:-}" ]; then
  container=(--container-image="$CONTAINER_IMAGE" --container-mounts="$PWD:$PWD"
             --container-workdir="$PWD")
fi
srun --kill-on-bad-exit=1 "${container[@]}" torchrun \
  --nnodes="$SLURM_NNODES" \
  --nproc_per_node="$nproc_per_node" \
  --rdzv-id="$SLURM_JOB_ID" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="$head_node:$port" \
  --max-restarts=3 \
  "$script" "$@"
