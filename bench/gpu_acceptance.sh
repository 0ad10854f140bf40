#!/usr/bin/env bash
# The day-one GPU acceptance check (issue 14): one command, one JSON, under 8 minutes on one H200.
#
#   bash bench/gpu_acceptance.sh [OUT.json]          # default runs/gpu_acceptance.json
#
# Megatron bf16 and FP8 training steps of a Qwen3-1.7B shape with MFU (bench/gpu_megatron.py); an SGLang GPU
# server's rollout tokens/s and weight sync by disk, tensor and distributed, each verified by the logprob probe, in
# seconds per billion parameters; 20-step GRPO and OPD runs of a Qwen3-0.6B shape on the HF backend (bf16 compute,
# fp32 masters) whose loss must move (bench/gpu_acceptance.py). SGLang comes from $MEGAOPD_SGLANG_PYTHON (or this
# python). Without a CUDA GPU it stops at once, exit status 2, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-runs/gpu_acceptance.json}
if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "bench/gpu_acceptance.sh: $PY cannot import torch (set PYTHON to the project's environment); nothing ran." >&2
    exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "bench/gpu_acceptance.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); nothing ran." >&2
    echo "It measures a GPU machine; on CPU the same paths are checked by: pytest -m shapes tests/test_shapes.py" >&2
    exit 2
fi
mkdir -p "$(dirname "$OUT")"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export CUDA_DEVICE_MAX_CONNECTIONS=1
# Megatron first (its own torchrun process): 4 timed steps after 2 warm-up, bf16 then FP8 when TE is present.
timeout 240 bash bench/gpu_megatron.sh --steps 4 --warmup 2 --seq 2048 --batch 16 --micro-batch 4 \
    --out "$WORK/megatron.json" > "$WORK/megatron.log" 2>&1 || echo "megatron part failed: see the JSON" >&2
timeout 420 "$PY" bench/gpu_acceptance.py --work "$WORK" --megatron "$WORK/megatron.json" \
    --megatron-log "$WORK/megatron.log" --out "$OUT"
echo "wrote $OUT"
