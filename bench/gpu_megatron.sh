#!/usr/bin/env bash
# Megatron backend on one GPU (an H200 in the issue): bf16 and, with Transformer Engine, FP8 training steps of a
# Qwen3-1.7B-shaped model; prints step time, tokens/s and MFU. Needs `pip install -e '.[megatron]'` (plus TE for
# FP8). Extra arguments go to bench/gpu_megatron.py (--seq, --batch, --micro-batch, --steps, --fp8, --out).
#
#   bash bench/gpu_megatron.sh --steps 6
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "bench/gpu_megatron.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False)." >&2
    echo "It measures GPU throughput and MFU; on CPU run the backend's checks instead: pytest tests/test_megatron.py" >&2
    exit 2
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1  # megatron's TP/SP comm-compute overlap expects it
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 bench/gpu_megatron.py "$@"
