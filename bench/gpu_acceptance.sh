#!/usr/bin/env bash
# The day-one GPU acceptance check: one command, one JSON of checks, each with its threshold; exit 0 only when
# every check that ran passed. Under 10 minutes on one H200.
#
#   bash bench/gpu_acceptance.sh [--model DIR] [OUT.json]      # default runs/gpu_acceptance.json
#   bash bench/gpu_acceptance.sh --dry-run [OUT.json]          # CPU, tiny shapes: the same script end to end
#
# Checks (bench/gpu_acceptance.py states each threshold): SFT loss and OPD KL fall, GRPO reward rises (fitted slope
# over its standard error) on --model DIR or, by default, SmolLM2-135M-Instruct imported from its PyPI package (the
# real extra), on natural-language word problems; peak CUDA memory within a margin of `megaopd plan`; Megatron bf16
# MFU of a Qwen3-1.7B shape above a floor and FP8 running (Transformer Engine absent = failure: bench/gpu_megatron.py);
# trainer vs SGLang logprobs on the same tokens; each SGLang weight sync verified, in seconds per billion parameters.
# In --dry-run the CUDA-only checks are listed with "skipped": "cuda-only". SGLang comes from this python.
# Extra `--set KEY=VALUE` overrides go to every training run (`--set optim.lr=0` makes the learning checks fail).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=() MODEL=() SETS=() OUT=runs/gpu_acceptance.json
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=(--dry-run) ;;
        --model) MODEL=(--model "$2"); shift ;;
        --set) SETS+=(--set "$2"); shift ;;
        -*) echo "bench/gpu_acceptance.sh: unknown option $1 (--dry-run, --model DIR, --set KEY=VALUE, OUT.json)" >&2
            exit 2 ;;
        *) OUT=$1 ;;
    esac
    shift
done
if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "bench/gpu_acceptance.sh: $PY cannot import torch (set PYTHON to the project's environment); nothing ran." >&2
    exit 2
fi
if [ ${#DRY[@]} -eq 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "bench/gpu_acceptance.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); nothing ran." >&2
    echo "On CPU the same script runs at tiny shapes with: bash bench/gpu_acceptance.sh --dry-run" >&2
    exit 2
fi
mkdir -p "$(dirname "$OUT")"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
MEGATRON=()
if [ ${#DRY[@]} -eq 0 ]; then
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    # Its own torchrun process: 4 timed steps after 2 warm-up, bf16 then FP8; its failure fails the checks it feeds.
    timeout 240 bash bench/gpu_megatron.sh --steps 4 --warmup 2 --seq 2048 --batch 16 --micro-batch 4 \
        --out "$WORK/megatron.json" > "$WORK/megatron.log" 2>&1 || tail -20 "$WORK/megatron.log" >&2
    MEGATRON=(--megatron "$WORK/megatron.json")
fi
status=0
timeout 480 "$PY" bench/gpu_acceptance.py --work "$WORK" --out "$OUT" "${DRY[@]}" "${MODEL[@]}" "${MEGATRON[@]}" \
    "${SETS[@]}" || status=$?
echo "wrote $OUT"
exit $status
