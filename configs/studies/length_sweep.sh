#!/usr/bin/env bash
# The response-length sweep (configs/studies/length_sweep.yaml): E3 at three solution lengths, then one plot of the
# GRPO/OPD FLOP ratio against response length.   bash configs/studies/length_sweep.sh [runs/length] [seeds]
#   e.g. bash configs/studies/length_sweep.sh runs/length "[0,1,2]"
set -euo pipefail
root=${1:-runs/length}
seeds=${2:-[]}
study=configs/studies/length_sweep.yaml
# verbosity:max_new_tokens (about twice each wording's solution length: ~20, ~60, ~150 tokens)
for point in 0:40 1:100 2:220; do
  megaopd study "$study" "out=$root/v${point%%:*}" "assets.verbosity.arith_add=${point%%:*}" \
    "vars.max_new=${point##*:}" "seeds=$seeds"
done
megaopd report --length-sweep "$root/v0" "$root/v1" "$root/v2" --out "$root/report"
