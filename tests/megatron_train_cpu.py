"""Test-only entry point: ``megaopd.megatron.launch`` on CPU, with megatron's CUDA-only calls redirected first.

    torchrun --nproc-per-node 2 tests/megatron_train_cpu.py CONFIG model.backend=megatron ...
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # megatron_cpu, megaopd
from megatron_cpu import redirect_cuda_to_cpu  # noqa: E402

if __name__ == "__main__":
    redirect_cuda_to_cpu()
    from megaopd.megatron.launch import main

    sys.exit(main())
