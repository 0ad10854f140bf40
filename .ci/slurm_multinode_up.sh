#!/usr/bin/env bash
# Start a 4-node Slurm cluster on this machine for tests/test_slurm_multinode.py (network namespaces, its own
# munged, one slurmd per node, stand-in GPUs): megaopd.launch.local_cluster, idle in about a second.
#
#   sudo .ci/slurm_multinode_up.sh      # idempotent; state, logs and PID files under $MEGAOPD_MULTINODE_STATE
#   .ci/slurm_multinode_down.sh         # daemons, job steps, namespaces and files, all gone
#
# Needs root and Debian's slurmctld/slurmd/slurm-client/munge (.ci/slurm_up.sh installs them).
set -euo pipefail

STATE=${MEGAOPD_MULTINODE_STATE:-/tmp/megaopd-multinode}
PY=${PY:-.venv/bin/python}
if ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi
exec "$PY" -m megaopd.launch.local_cluster up --nodes 4 --state "$STATE" --name mns --subnet 10.77.0
