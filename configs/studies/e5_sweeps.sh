#!/usr/bin/env bash
# E5: small sweeps of the self-teacher study (configs/studies/self_teacher.yaml) over task difficulty, student
# size and teacher size, each point its own study directory, then one report per sweep.
#   bash configs/studies/e5_sweeps.sh [runs/e5]
set -euo pipefail
root=${1:-runs/e5}
study=configs/studies/self_teacher.yaml
for digits in 2 3; do        # difficulty: digits per operand
  megaopd study "$study" "out=$root/difficulty_$digits" "assets.difficulty.arith_add=$digits"
done
for student in qwen3-tiny qwen3-small qwen3-base; do   # student size (the teacher is its own GRPO checkpoint)
  megaopd study "$study" "out=$root/student_$student" "vars.student=$student"
done
for teacher in qwen3-small qwen3-base; do              # teacher size: the 2-domain study's external teacher
  megaopd study configs/studies/two_domain.yaml "out=$root/teacher_$teacher" "vars.teacher=$teacher"
done
