#!/usr/bin/env bash
# Stop the cluster of .ci/slurm_multinode_up.sh: daemons by PID file, every process left in its namespaces, the
# namespaces, /etc/netns entries and its state files. Safe to run on a partial or absent cluster.
set -uo pipefail

STATE=${MEGAOPD_MULTINODE_STATE:-/tmp/megaopd-multinode}
PY=${PY:-.venv/bin/python}
exec "$PY" -m megaopd.launch.local_cluster down --nodes 4 --state "$STATE" --name mns
