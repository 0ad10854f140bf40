# shellcheck shell=bash
# Shared by slurm/stage.sbatch and slurm/stage_multinode.sbatch (sourced, not run on its own): the job's
# environment, running the trainer so that a preemption ends in a checkpoint, and requeueing afterwards.
#
# Preemption: Slurm signals the batch shell (#SBATCH --signal=B:USR1@<secs>) before the time limit, and sends
# SIGTERM on preemption. The trap below passes USR1 on to the trainer's srun, which forwards it to its tasks;
# the trainer finishes its step, writes a checkpoint and exits 75 (megaopd.trainer.PREEMPTED_EXIT). The job
# then requeues itself, and the requeued job runs the same command, which resumes from that checkpoint.

PREEMPTED_EXIT=75
PREEMPTED=0
TRAINER_PID=

# Activate $VENV (if set) and build CONTAINER_ARGS: pyxis/enroot flags for srun (empty without an image).
megaopd_setup() {
  if [[ -n ${VENV:-} ]]; then
    # shellcheck source=/dev/null
    source "$VENV/bin/activate"
  fi
  # torch sizes its thread pool by the node's cores, not by this job's share of them.
  export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-${OMP_NUM_THREADS:-1}}
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
