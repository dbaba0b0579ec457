#!/usr/bin/env bash
# A real Slurm cluster on this one machine: munged, slurmctld and two slurmd that stand in for
# two nodes (node1, node2). sbatch_run.sh runs on it exactly as on a cluster; only the GPU and
# CPU requests are overridden on the sbatch command line (a laptop has neither 4 GPUs nor 16
# CPUs per "node"). start and stop need root (apt-get, the daemons), submit does not; nothing
# is started through systemd.
#
#   bash slurm_scripts/local_cluster.sh start      # installs slurm-wlm and munge if missing
#   export SLURM_CONF=/tmp/ddp-series-slurm/slurm.conf
#   NPROC_PER_NODE=1 bash slurm_scripts/local_cluster.sh submit 300 --cpus-per-task=1 \
#       --gpus-per-node=0 slurm_scripts/sbatch_run.sh 5 2 --device cpu
#   bash slurm_scripts/local_cluster.sh stop
#
# SLURM_LOCAL_DIR (default /tmp/ddp-series-slurm) holds the config, state, logs and pid files;
# SLURM_LOCAL_PORT (default 17000) is slurmctld's port, the two slurmd listen on the next two.
# SLURM_LOCAL_FIRST_JOB_ID (default 1): sbatch_run.sh's rendezvous port is 29500 + job id % 1000.
# Each directory is its own cluster (own munged socket, own ports): two can run side by side.
set -euo pipefail
PATH="$PATH:/usr/sbin:/sbin"  # the daemons and runuser live there; a user's PATH may lack them

dir="${SLURM_LOCAL_DIR:-/tmp/ddp-series-slurm}"
port="${SLURM_LOCAL_PORT:-17000}"
first_job="${SLURM_LOCAL_FIRST_JOB_ID:-1}"
conf="$dir/slurm.conf"
host=$(hostname -s)  # slurmctld and slurmd check that they run on the host the config names

die() { echo "error: $*" >&2; exit 1; }
# Exit 3: this machine cannot run the cluster (not root, no apt-get, no network); a test skips.
unavailable() { echo "error: $*" >&2; exit 3; }

install() {
  # Skipped where the tools are there already: a second run costs nothing.
  local tool missing=0
  for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || missing=1
  done
  [ "$missing" -eq 1 ] || return 0
  [ "$(id -u)" -eq 0 ] || unavailable "installing slurm-wlm and munge needs root"
  command -v apt-get >/dev/null || unavailable "no apt-get: install slurm-wlm and munge yourself"
  # --no-install-recommends: 9 packages instead of dozens (no mail server, no docs);
  # policy-rc.d may refuse to start the services: we start the daemons ourselves below.
  # The lock timeout: another apt-get (or a second cluster starting) may hold dpkg's lock.
  export DEBIAN_FRONTEND=noninteractive
  local apt=(apt-get -y -q -o DPkg::Lock::Timeout=120)
  "${apt[@]}" install --no-install-recommends slurm-wlm munge >"$dir/apt.log" 2>&1 || {
    # A fresh machine may have no package lists yet (or stale ones): fetch them and retry.
    "${apt[@]}" update >>"$dir/apt.log" 2>&1 \
      && "${apt[@]}" install --no-install-recommends slurm-wlm munge >>"$dir/apt.log" 2>&1
  } || unavailable "apt-get install slurm-wlm munge failed: $(tail -n 3 "$dir/apt.log" | tr '\n' ' ')"
}

write_config() {
  local cpus
  cpus=$(getconf _NPROCESSORS_ONLN)
  # Everything lives under $dir: no Slurm or munge file in /etc is read or edited.
  cat >"$conf" <<EOF
ClusterName=ddp-series
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/slurmctld
SlurmdSpoolDir=$dir/slurmd-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
# No cgroups in a container: track job processes through /proc, bind no CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
# CR_CPU: two small jobs may share a node, as on a real cluster's CPU partition.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
ReturnToService=2
# scancel sends SIGTERM, then SIGKILL after KillWait seconds (default 30).
KillWait=2
# sbatch --wait polls every 2 s, then 8 s, then 32 s, unless a finished job may be forgotten
# (MinJobAge, default 300 s) before the next poll: 6 s keeps it at 2 s.
MinJobAge=6
FirstJobId=$first_job
# Two slurmd on one host: each gets a node name (slurmd -N) and a port of its own, and all the
# host's CPUs (getconf, not nproc: nproc counts OMP_NUM_THREADS, often 1 in a test).
NodeName=node[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$((port + 1))-$((port + 2))] CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

resolve_node_names() {
  # sbatch_run.sh meets at the first node by its Slurm name, as on a cluster whose DNS knows
  # every node; here /etc/hosts must. The line is left in place: harmless, and another local
  # cluster may be using it.
  getent hosts node1 node2 >/dev/null 2>&1 && [ "$(getent hosts node1 node2 | wc -l)" -eq 2 ] \
    || echo "127.0.0.1 node1 node2  # slurm_scripts/local_cluster.sh" >>/etc/hosts \
    || unavailable "node1 and node2 do not resolve and /etc/hosts is not writable"
}

start() {
  [ "$(id -u)" -eq 0 ] || unavailable "the local cluster needs root (munged, slurmctld, slurmd)"
  [ ! -e "$dir/slurmctld.pid" ] || die "$dir holds a running cluster: run '$0 stop' first"
  mkdir -p "$dir"
  chmod 755 "$dir"  # munged (user munge) must reach its socket directory inside it
  # Whatever fails from here on (a daemon, a timeout, set -e): stop what has started, so that
  # no daemon outlives a failed start. Cleared once the cluster is up.
  trap 'status=$?; [ "$status" -eq 0 ] || stop >/dev/null 2>&1; exit "$status"' EXIT
  install
  write_config
  resolve_node_names
  # munged refuses a socket directory that others can write to or that munge does not own.
  mkdir -p "$dir/munge" "$dir/slurmctld"
  chown munge:munge "$dir/munge"
  chmod 755 "$dir/munge"
  # Its own socket, pid and seed files: no /run/munge needed (the package's default, which
  # must exist and belong to munge), and never the munged of another cluster or the system.
  runuser -u munge -- munged --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
    --seed-file="$dir/munge/munged.seed" || die "munged did not start: $dir/munge/munged.log"
  # -c: a clean start, no jobs or node states from an earlier cluster in this directory.
  slurmctld -c -f "$conf" || die "slurmctld did not start: see $dir/slurmctld.log"
  for node in node1 node2; do
    slurmd -N "$node" -f "$conf" || die "slurmd -N $node did not start: $dir/slurmd-$node.log"
  done
  # Ready when both nodes report idle (about 2 s): a job submitted before would wait. The
  # daemons fork before they bind their ports: a port in use shows only here, and in the log.
  local idle deadline=$((SECONDS + 20))
  while [ "$SECONDS" -lt "$deadline" ]; do
    idle=$(SLURM_CONF="$conf" timeout 2 sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l) \
      || true  # timeout: without slurmctld sinfo retries for 10 s
    if [ "$idle" -eq 2 ]; then
      trap - EXIT
      echo "local cluster up: export SLURM_CONF=$conf"
      return
    fi
    kill -0 "$(cat "$dir/slurmctld.pid" 2>/dev/null || echo 0)" 2>/dev/null \
      || die "slurmctld stopped: $(grep -m1 'fatal' "$dir/slurmctld.log" || echo "see $dir")"
    sleep 0.2
  done
  die "the nodes did not become idle within 20 s: see $dir/*.log"
}

submit() {
  # sbatch --wait waits forever for a request the cluster can never satisfy (too many CPUs, a
  # GPU): bound it, and cancel the job so that it does not run later on.
  local limit="$1"; shift
  # Without its config sbatch retries for 60 s before it fails: say so at once.
  [ -e "$conf" ] || die "no cluster in $dir: run '$0 start' (and set SLURM_LOCAL_DIR alike)"
  export SLURM_CONF="$conf"
  local status=0 job out
  out=$(mktemp)
  # --parsable prints the job id at submission; it is read back only after the wait.
  # --foreground: sbatch stays in the caller's process group, so killing that group ends it.
  timeout --foreground "$limit" sbatch --wait --parsable "$@" >"$out" || status=$?
  job=$(cut -d';' -f1 "$out")
  rm -f "$out"
  if [ "$status" -eq 124 ]; then
    # Why it waited (Reason=PartitionConfig: more CPUs or nodes than the partition has), read
    # before scancel replaces it.
    local why=""
    # (timeout: with the cluster gone, scontrol and scancel retry for a minute).
    [ -z "$job" ] || why=$(timeout 10 scontrol show job "$job" 2>/dev/null \
      | grep -o 'JobState=[^ ]*\|Reason=[^ ]*' | tr '\n' ' ') || true
    [ -z "$job" ] || timeout 10 scancel "$job" || true
    echo "error: job ${job:-?} did not finish within $limit s (${why% }); cancelled" >&2
  fi
  echo "$job"
  return "$status"
}

stop() {
  export SLURM_CONF="$conf"
  # Jobs first, so that each slurmstepd ends with its job instead of outliving its slurmd. Only
  # while slurmctld runs: without it scancel and squeue retry for many seconds.
  if [ "$(cat "/proc/$(cat "$dir/slurmctld.pid" 2>/dev/null || echo 0)/comm" 2>/dev/null)" \
      = slurmctld ]; then
    timeout 10 scancel --full --quiet --partition=local 2>/dev/null || true
    for _ in $(seq 50); do
      [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  # Only the processes this directory's pid files name, never other clusters' daemons; and
  # only while they are still the daemon (a stale file's pid may belong to anything by now).
  local pids=() f pid
  for f in "$dir"/slurmd-node1.pid "$dir"/slurmd-node2.pid "$dir"/slurmctld.pid \
      "$dir"/munge/munged.pid; do
    [ -e "$f" ] || continue
    pid=$(cat "$f")
    rm -f "$f"
    case "$(cat "/proc/$pid/comm" 2>/dev/null)" in
      slurmd | slurmctld | munged) pids+=("$pid") ;;
    esac
  done
  [ "${#pids[@]}" -gt 0 ] || return 0
  kill "${pids[@]}" 2>/dev/null || true
  local alive
  for _ in $(seq 50); do
    alive=0
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null && alive=1
    done
    [ "$alive" -eq 1 ] || return 0
    sleep 0.1
  done
  kill -9 "${pids[@]}" 2>/dev/null || true  # one that ignored SIGTERM for 5 s
}

case "${1:-}" in
  install) mkdir -p "$dir"; install ;;
  start) start ;;
  submit) shift; [ $# -ge 2 ] || die "usage: $0 submit SECONDS [sbatch options] SCRIPT [args]"
          submit "$@" ;;
  stop) stop ;;
  *) echo "usage: $0 install|start|submit SECONDS SBATCH_ARGS...|stop" >&2; exit 2 ;;
esac
