"""How the job steps of a multi-node stage (slurm/stage_multinode.sbatch) take a preemption's SIGTERM.

    python megaopd/launch/step_signals.py server -m sglang.launch_server --model-path ...   # each server step
    python megaopd/launch/step_signals.py trainer torchrun --node-rank=... -m ...           # each trainer node

A preemption signals every process of every step with SIGTERM. The trainer then finishes its step and writes a
checkpoint, and for that it still needs its rollout and teacher servers:

- ``server`` runs a module as ``python -m`` would, deaf to SIGTERM: a handler the module installs for it later
  (uvicorn's graceful shutdown) is not installed, and its subprocesses inherit the ignored signal. The servers stop
  when the batch script ends (it kills their srun, which kills the step), or by SIGKILL when the grace time is over.
- ``trainer`` runs torchrun and exits with its status, or with 75 (megaopd.run.trainer.PREEMPTED_EXIT) when a
  preemption signal reached the step and torchrun then failed: its workers checkpointed and exited 75, but torchrun
  itself exits 1 after a signal. The batch shell may not have been signalled at all, so this status is what tells
  it to requeue. (In Python, not bash: bash 5.2 loses the status of a child that exits while a trap runs.)

Run by path (``server`` in SGLang's own environment): no megaopd import.
"""

import os
import runpy
import signal
import subprocess
import sys

PREEMPTED_EXIT = 75  # megaopd.run.trainer.PREEMPTED_EXIT, which this file cannot import
_install = signal.signal


def _keep_term_ignored(signum, handler):
    if signum == signal.SIGTERM:
        return signal.SIG_IGN
    return _install(signum, handler)


def server(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "-m":
        sys.exit("usage: step_signals.py server -m MODULE [ARG ...]")
    _install(signal.SIGTERM, signal.SIG_IGN)
    signal.signal = _keep_term_ignored
    sys.argv = [argv[1], *argv[2:]]
    sys.path[0] = os.getcwd()  # as with -m: the current directory, not this file's
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


def trainer(argv: list[str]) -> int:
    signalled = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # they reach torchrun too: nothing to pass on
        signal.signal(sig, lambda signum, frame: signalled.append(signum))
    status = subprocess.call(argv)
    status = 128 - status if status < 0 else status  # killed by a signal, as a shell reports it
    return PREEMPTED_EXIT if signalled and status != 0 else status


if __name__ == "__main__":
    if sys.argv[1:2] == ["server"]:
        server(sys.argv[2:])
    elif sys.argv[1:2] == ["trainer"] and len(sys.argv) > 2:
        sys.exit(trainer(sys.argv[2:]))
    else:
        sys.exit("usage: step_signals.py server -m MODULE [ARG ...] | trainer COMMAND [ARG ...]")
