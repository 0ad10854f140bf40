#!/usr/bin/env bash
# Install, configure and start a one-node Slurm cluster (Debian packages) for tests/test_slurm_cluster.py.
#
#   sudo .ci/slurm_up.sh        # idempotent; state, logs and PID files under $MEGAOPD_SLURM_STATE
#   .ci/slurm_down.sh           # stops the daemons by their PID files
#
# Everything stays on this host (loopback): munged, slurmctld and slurmd. Needs root (SlurmUser=root) because
# the CI runs as root and jobs run as the submitting user.
set -euo pipefail

STATE=${MEGAOPD_SLURM_STATE:-/tmp/megaopd-slurm}
CONF=/etc/slurm/slurm.conf  # the client tools (sbatch, squeue, ...) read it from here without extra env

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$STATE"/{ctld,spool,log,run} /etc/slurm /run/munge
chown munge:munge /run/munge
[[ -s /etc/munge/munge.key ]] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; \
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- munged --force 2>/dev/null || munged --force
fi

host=$(hostname)
mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
cat >"$CONF" <<CONF
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it can start again (default 120 s); short here for tests.
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
NodeName=$host CPUs=$(nproc) RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

running() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
running "$STATE/run/slurmctld.pid" || slurmctld
running "$STATE/run/slurmd.pid" || slurmd

# The node reports in within seconds; a node left down/drained by an earlier session is resumed.
for _ in $(seq 60); do
  node_state=$(sinfo -h -N -o %T 2>/dev/null | head -n1 || true)
  case $node_state in
    idle*|mixed*|allocated*) echo "slurm up: $host $node_state (state in $STATE)"; exit 0 ;;
    down*|drain*) scontrol update NodeName="$host" State=RESUME || true ;;
  esac
  sleep 1
done
echo "slurm did not come up; see $STATE/log" >&2
exit 1
