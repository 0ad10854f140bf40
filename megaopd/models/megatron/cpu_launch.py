"""The trainer entry point of CPU rehearsals and CI: ``megaopd.models.megatron.launch`` with megatron's CUDA-only calls
redirected to the CPU first (``megaopd.models.megatron.cpu_rehearsal``). Never the entry point on a GPU cluster.

    torchrun --nproc-per-node 2 -m megaopd.models.megatron.cpu_launch CONFIG model.backend=megatron ...

In a launch file: ``trainer_module: megaopd.models.megatron.cpu_launch`` (the default is ``megaopd.models.megatron.launch``).
"""

import os
import socket
import sys

from megaopd.models.megatron.cpu_rehearsal import redirect_cuda_to_cpu


def main(argv: list[str] | None = None) -> int:
    # Where each rank landed, one line per rank: rehearsals and the multi-node tests read the layout from it.
    print(f"megaopd: rank {os.environ.get('RANK', 0)}/{os.environ.get('WORLD_SIZE', 1)} local "
          f"{os.environ.get('LOCAL_RANK', 0)} on {socket.gethostname()}", flush=True)
    redirect_cuda_to_cpu()
    from megaopd.models.megatron.launch import main as launch

    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
