# shellcheck shell=bash
# Shared by slurm/stage.sbatch and slurm/stage_multinode.sbatch (sourced, not run on its own): the job's
# environment, running the trainer so that a preemption ends in a checkpoint, and requeueing afterwards.
#
# Preemption: Slurm signals the batch shell (#SBATCH --signal=B:USR1@<secs>) before the time limit, and sends
# SIGTERM on preemption. The trap below passes USR1 on to the trainer's srun, which forwards it to its tasks;
# the trainer finishes its step, writes a checkpoint and exits 75 (megaopd.run.trainer.PREEMPTED_EXIT). The job
# then requeues itself, and the requeued job runs the same command, which resumes from that checkpoint.
# A SIGTERM to the job's steps (scancel --signal=TERM; what many sites' preemption sends) reaches the trainer
# directly, which does the same; the multi-node script's server steps outlive it (megaopd/launch/step_signals.py).
# srun itself turns a SIGTERM it receives into a SIGKILL of its step, so a SIGTERM to the batch shell's children
# cannot be survived: see docs/cluster.md, "Preemption and time limits".

PREEMPTED_EXIT=75
PREEMPTED=0
TRAINER_PID=

# Activate $VENV (if set), export the network and thread settings that every step inherits, and build STEP_ARGS
# (a step's CPUs: one task per node, with $1 workers) and CONTAINER_ARGS (pyxis/enroot flags for srun, empty
# without an image).
megaopd_setup() {
  local workers=${1:-1}
  if [[ -n ${VENV:-} ]]; then
    # shellcheck source=/dev/null
    source "$VENV/bin/activate"
  fi
  # Left to themselves NCCL and Gloo may pick a management network or docker0 (launch setting socket_ifname).
  if [[ -n ${SOCKET_IFNAME:-} ]]; then export NCCL_SOCKET_IFNAME=$SOCKET_IFNAME GLOO_SOCKET_IFNAME=$SOCKET_IFNAME; fi
  if [[ -n ${IB_HCA:-} ]]; then export NCCL_IB_HCA=$IB_HCA; fi
  # A step gets one CPU per task unless srun asks for more (Slurm >= 22.05 no longer passes the job's
  # --cpus-per-task on): each step takes the job's CPUs on its node, and torch's thread pool is sized by that
  # share over the workers, not by the node's cores or by what the submitting shell exported.
  local cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}
  # shellcheck disable=SC2034  # used by the scripts that source this file
  STEP_ARGS=(--cpus-per-task="$cpus")
  if [[ -n ${CPU_BIND:-} ]]; then STEP_ARGS+=(--cpu-bind="$CPU_BIND"); fi
  export OMP_NUM_THREADS=$((cpus / workers > 0 ? cpus / workers : 1))
  CONTAINER_ARGS=()
  if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    # The --container-* flags come from the pyxis plugin; without it srun would reject them on every step.
    local help
    help=$(srun --help 2>&1 || true)  # not piped into grep -q: srun would die of SIGPIPE under pipefail
    if [[ $help != *--container-image* ]]; then
      echo "megaopd: CONTAINER_IMAGE is set but this cluster's srun has no --container-image (pyxis is not" \
        "installed): leave the launch setting container_image empty and use venv instead" >&2
      exit 1
    fi
    local mounts=$WORKDIR:$WORKDIR
    [[ -n ${CONTAINER_MOUNTS:-} ]] && mounts+=,$CONTAINER_MOUNTS
    # shellcheck disable=SC2034  # used by the scripts that source this file
    CONTAINER_ARGS=(--container-image="$CONTAINER_IMAGE" --container-mounts="$mounts"
                    --container-workdir="$WORKDIR" --no-container-mount-home)
  fi
}

# The address of Slurm node $1 (its NodeAddr; the name itself when Slurm gives none).
megaopd_node_addr() {
  local addr
  addr=$(scontrol show node "$1" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
  echo "${addr:-$1}"
}

megaopd_on_signal() {
  PREEMPTED=1
  echo "megaopd: $1 received; asking the trainer to checkpoint and exit" >&2
  [[ -n $TRAINER_PID ]] && kill -USR1 "$TRAINER_PID" 2>/dev/null
  return 0
}

# Run the trainer's job step ("$@", an srun command line) in the background so that this shell can take
# signals while it runs; return its exit status.
megaopd_run_trainer() {
  trap 'megaopd_on_signal USR1' USR1
  trap 'megaopd_on_signal TERM' TERM
  "$@" &
  TRAINER_PID=$!
  local status=0 again alive
  wait "$TRAINER_PID" || status=$?
  # A trapped signal interrupts wait (status > 128) while the trainer checkpoints, or just as it exits: wait
  # again for the trainer's own exit status. A trainer already gone had that status (bash 5 reports it again
  # for every wait, older bash says 127): stop there rather than wait forever.
  while ((status > 128)); do
    alive=0
    kill -0 "$TRAINER_PID" 2>/dev/null && alive=1
    again=0
    wait "$TRAINER_PID" || again=$?
    ((again == 127)) && break
    status=$again
    ((alive)) || break
  done
  return "$status"
}

# Exit with the trainer's status ($1), requeueing the job first if the trainer stopped for a preemption.
megaopd_finish() {
  local status=$1
  if ((status == PREEMPTED_EXIT || (PREEMPTED && status != 0))); then
    if ((${SLURM_RESTART_COUNT:-0} >= MAX_REQUEUES)); then
      echo "megaopd: preempted after ${SLURM_RESTART_COUNT} requeues (MAX_REQUEUES=$MAX_REQUEUES); giving up" >&2
      exit "$status"
    fi
    echo "megaopd: preempted (status $status); requeueing job $SLURM_JOB_ID to resume from its checkpoint" >&2
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit "$status"
}
