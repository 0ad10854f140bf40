"""Test-only entry point: ``megaopd.models.megatron.launch`` on CPU (``megaopd.models.megatron.cpu_launch`` run as a script).

    torchrun --nproc-per-node 2 tests/megatron_train_cpu.py CONFIG model.backend=megatron ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # megaopd
from megaopd.models.megatron.cpu_launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
