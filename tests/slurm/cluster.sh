#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the tests (Debian's slurm-wlm 22.05 and munge; run as root).
#
#   tests/slurm/cluster.sh install              # apt-get install slurm-wlm munge, no service started
#   tests/slurm/cluster.sh start DIR [cpu|gpu-model]
#   tests/slurm/cluster.sh stop DIR
#   . DIR/env                                   # SLURM_CONF=DIR/slurm.conf: sbatch, squeue, ... talk to it
#
# Everything of a cluster lives under DIR (a fresh folder, owned by the `slurm` user): its own munged
# (its own key and socket), slurm.conf, slurmctld's state, slurmd's spool, pid and log files. Two clusters
# (two DIRs, one of each mode) run side by side: each mode has its own ports and cluster name.
#   cpu        the machine as it is (`slurmd -C`: its CPUs and memory); partitions `cpu` (the default) and
#              `gpu` on that one node, so the SLURM profile's GPU rules have their partition here too (the
#              CPU-only configs take no GPU). Memory is a consumable resource (CR_Core_Memory) and
#              jobacct_gather/linux with OverMemoryKill kills a job whose processes outgrow its --mem;
#              the time limit is enforced by slurmctld.
#   gpu-model  the study's GPU node, modelled: 8 GPUs (GRES `gpu`, device files that are links to
#              /dev/null, the GPUs are counted, not used), 128 CPUs and 2,000,000 MB, declared larger than
#              the machine (SlurmdParameters=config_overrides); partitions `gpu` and `cpu` with a
#              24-hour MaxTime enforced at submission (EnforcePartLimits=ALL). For `sbatch --test-only`
#              only: a job submitted here would run on this machine.
# PropagatePrioProcess=1: a job runs at the nice value of the process that submitted it (the tests' over-limit
# jobs at 19: they only burn time the other tests leave idle).
# No cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none) and no accounting storage (no
# slurmdbd, no database): `sacct` answers "accounting storage is disabled", so Snakemake's plugin takes
# `--slurm-status-command squeue`, with MinJobAge high enough that squeue still lists a finished job.
set -euo pipefail

RUN_CONF=/run/slurm/conf/slurm.conf

die() { echo "cluster.sh: $*" >&2; exit 1; }

install_packages() {
  command -v apt-get >/dev/null 2>&1 || die "no apt-get: install slurm-wlm and munge yourself"
  [ "$(id -u)" = 0 ] || die "not root: cannot install slurm-wlm and munge"
  # a policy-rc.d that denies service starts: the packages' daemons must not start themselves
  local policy=/usr/sbin/policy-rc.d restore=""
  if [ -e "$policy" ]; then restore=$(mktemp); cp -p "$policy" "$restore"; fi
  printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"
  local rc=0
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
     slurm-wlm munge >/dev/null) || rc=$?
  if [ -n "$restore" ]; then mv "$restore" "$policy"; else rm -f "$policy"; fi
  return $rc
}

wait_for() {  # wait_for SECONDS CMD...: until CMD succeeds
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.5
  done
}

start() {
  local dir=$1 mode=${2:-cpu}
  [ "$(id -u)" = 0 ] || die "start needs root (slurmd runs as root, slurmctld as the slurm user)"
  for cmd in munged slurmctld slurmd sbatch mungekey; do
    command -v "$cmd" >/dev/null 2>&1 || die "$cmd not found: run '$0 install' (Debian: slurm-wlm munge)"
  done
  local port name host
  case $mode in
    cpu) port=6917 name=rpacpu ;;
    gpu-model) port=6927 name=rpagpu ;;
    *) die "unknown mode '$mode' (cpu or gpu-model)" ;;
  esac
  host=$(hostname -s)
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ ! -e "$dir/slurmctld.pid" ] || die "$dir already holds a cluster (stop it first)"
  mkdir -p "$dir"/{munge,state,spool,log,dev}
  chmod 755 "$dir"

  # munge: its own key and socket
  mungekey -c -f -k "$dir/munge/munge.key" >/dev/null 2>&1 || \
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=1024 status=none
  chown -R munge:munge "$dir/munge"; chmod 700 "$dir/munge"; chmod 600 "$dir/munge/munge.key"
  chmod 711 "$dir/munge"  # the daemons (root, slurm) reach the socket; the key stays unreadable
  runuser -u munge -- munged --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed" \
    || die "munged did not start (log: $dir/munge/munged.log)"
  wait_for 10 test -S "$dir/munge/munge.socket" || die "munged made no socket"

  local node
  if [ "$mode" = cpu ]; then
    # the machine's own CPUs and memory, as slurmd finds them
    node=$(slurmd -C | head -1 | sed "s/^NodeName=[^ ]*/NodeName=$host/")
    node="$node NodeAddr=127.0.0.1 State=UNKNOWN"
    cat > "$dir/limits.conf" <<EOF
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=2
JobAcctGatherParams=OverMemoryKill
PartitionName=cpu Nodes=$host Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$host MaxTime=INFINITE State=UP
EOF
  else
    for i in 0 1 2 3 4 5 6 7; do ln -sf /dev/null "$dir/dev/nvidia$i"; done
    printf 'AutoDetect=off\nName=gpu File=%s/dev/nvidia[0-7]\n' "$dir" > "$dir/gres.conf"
    node="NodeName=$host NodeAddr=127.0.0.1 CPUs=128 Boards=1 SocketsPerBoard=2 CoresPerSocket=64"
    node="$node ThreadsPerCore=1 RealMemory=2000000 Gres=gpu:8 State=UNKNOWN"
    cat > "$dir/limits.conf" <<EOF
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/none
GresTypes=gpu
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
PartitionName=gpu Nodes=$host Default=NO MaxTime=1-00:00:00 State=UP
PartitionName=cpu Nodes=$host Default=YES MaxTime=1-00:00:00 State=UP
EOF
  fi
  cat > "$dir/slurm.conf" <<EOF
# written by tests/slurm/cluster.sh ($mode)
ClusterName=$name
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
ReturnToService=2
MinJobAge=3600
KillWait=5
PropagatePrioProcess=1
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
$(grep -v '^PartitionName' "$dir/limits.conf")
$node
$(grep '^PartitionName' "$dir/limits.conf")
EOF
  rm "$dir/limits.conf"
  chown -R slurm:slurm "$dir/state" "$dir/log" "$dir/dev"
  chown slurm:slurm "$dir"
  echo "export SLURM_CONF=$dir/slurm.conf" > "$dir/env"

  export SLURM_CONF=$dir/slurm.conf
  if [ "$mode" = cpu ]; then
    # where a client finds slurm.conf without SLURM_CONF (the file a configless slurmd keeps): the plugin's
    # job step (snakemake-executor-plugin-slurm-jobstep 0.6.1) drops SLURM_CONF from the environment of
    # the `srun` it starts inside the job, which would otherwise fail with "Could not establish a
    # configuration source"
    if [ -e "$RUN_CONF" ] && [ ! -L "$RUN_CONF" ]; then
      die "$RUN_CONF exists and is not ours: a SLURM runs here already"
    fi
    mkdir -p "$(dirname "$RUN_CONF")"
    ln -sfn "$dir/slurm.conf" "$RUN_CONF"
  fi
  slurmctld -c -f "$SLURM_CONF" || die "slurmctld did not start (log: $dir/log/slurmctld.log)"
  wait_for 30 scontrol ping || die "slurmctld does not answer (log: $dir/log/slurmctld.log)"
  slurmd -f "$SLURM_CONF" || die "slurmd did not start (log: $dir/log/slurmd.log)"
  # the node up and idle (a modelled node may come up drained after a restart: resume it)
  local deadline=$((SECONDS + 60)) state
  while :; do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null | head -1)
    case $state in
      idle|mixed|allocated) break ;;
      drain*|down*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
    esac
    [ $SECONDS -lt $deadline ] || die "node $host is '$state', not idle (logs: $dir/log)"
    sleep 0.5
  done
  echo "cluster.sh: $mode cluster $name up in $dir (SLURM_CONF=$SLURM_CONF): $(sinfo -h -o '%P %D %c %m %G' | tr '\n' ';')"
}

stop() {
  local dir=$1
  # a start that failed before writing slurm.conf can still have started munged: stop what the folder's pid files
  # name, and refuse only a folder with none of them
  [ -f "$dir/slurm.conf" ] || [ -f "$dir/munge/munged.pid" ] || [ -f "$dir/slurmctld.pid" ] || [ -f "$dir/slurmd.pid" ] \
    || die "no cluster in $dir"
  local pid p
  if [ -f "$dir/slurm.conf" ]; then
    export SLURM_CONF=$dir/slurm.conf
    scontrol shutdown >/dev/null 2>&1 || true
  fi
  for p in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
    [ -f "$p" ] || continue
    pid=$(cat "$p")
    wait_for 30 sh -c "! kill -0 $pid" || kill "$pid" 2>/dev/null || true
    rm -f "$p"
  done
  if [ -f "$dir/munge/munged.pid" ]; then
    pid=$(cat "$dir/munge/munged.pid")
    kill "$pid" 2>/dev/null || true
    wait_for 10 sh -c "! kill -0 $pid" || true
  fi
  if [ "$(readlink "$RUN_CONF" 2>/dev/null)" = "$dir/slurm.conf" ]; then
    rm -f "$RUN_CONF"
    rmdir "$(dirname "$RUN_CONF")" 2>/dev/null || true  # the folder start made, if nothing else is in it
  fi
  echo "cluster.sh: cluster in $dir stopped"
}

case ${1:-} in
  install) install_packages ;;
  start) [ $# -ge 2 ] || die "usage: $0 start DIR [cpu|gpu-model]"; start "$2" "${3:-cpu}" ;;
  stop) [ $# -ge 2 ] || die "usage: $0 stop DIR"; stop "$2" ;;
  *) die "usage: $0 install | start DIR [cpu|gpu-model] | stop DIR" ;;
esac
