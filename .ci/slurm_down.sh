#!/usr/bin/env bash
# Stop the one-node Slurm cluster started by .ci/slurm_up.sh, by its daemons' PID files.
set -uo pipefail

STATE=${MEGAOPD_SLURM_STATE:-/tmp/megaopd-slurm}
for daemon in slurmd slurmctld; do
  pidfile=$STATE/run/$daemon.pid
  if [[ -s $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    pid=$(cat "$pidfile")
    kill "$pid"
    # Wait so that a following slurm_up.sh does not find the old daemon still holding its port.
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
done
