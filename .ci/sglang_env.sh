#!/usr/bin/env bash
# Build SGLang's own environment for the real-server tests (`make setup-sglang`):
#
#   .ci/sglang_env.sh [VENV]     # default .venv-sglang; a no-op once VENV/.installed exists
#
# sglang 0.5.23 pins torch 2.14.1 (a CUDA build that also runs on CPU), so the environment is large: 10.5 GB
# installed, 12 GB at the peak of the install (measured with --no-cache-dir), and the tests need room too. Where
# the disk cannot hold it (checked before, or the install hits a full disk), the half-built environment is
# removed and the reason goes to VENV.unavailable. Locally the script then exits 0: the SGLang tests skip and print
# that reason, and the rest of the suite still runs. In CI ($CI set) it exits 1, so a run whose SGLang suite did not
# run cannot pass, unless MEGAOPD_ALLOW_SGLANG_SKIP=1 says that this machine truly cannot hold it (the opt-out;
# say so in the run's note). Any other install failure fails the build.
set -uo pipefail

VENV=${1:-.venv-sglang}
NEED_GB=${MEGAOPD_SGLANG_NEED_GB:-14}
UNAVAILABLE=$VENV.unavailable

rm -f "$UNAVAILABLE"
[ -f "$VENV/.installed" ] && exit 0

free_gb() { df -P -BG "$(dirname "$(realpath -m "$VENV")")" | awk 'NR == 2 {print int($4)}'; }
give_up() {
  rm -rf "$VENV"
  echo "$1" > "$UNAVAILABLE"
  if [ -n "${CI:-}" ] && [ "${MEGAOPD_ALLOW_SGLANG_SKIP:-}" != 1 ]; then
    echo "setup-sglang: $1; in CI the SGLang suite must run (set MEGAOPD_ALLOW_SGLANG_SKIP=1 where the machine" \
      "cannot hold it, and say so)" >&2
    exit 1
  fi
  echo "setup-sglang: $1; the SGLang tests will skip" >&2
  exit 0
}

free=$(free_gb)
[ "$free" -ge "$NEED_GB" ] || give_up "only $free GB free on the disk of $VENV, which needs $NEED_GB GB"

python3 -m venv "$VENV" || exit 1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$VENV/bin/python" -m pip install --quiet --no-cache-dir sglang==0.5.23 2>"$log"; then
  grep -v "is ignored: it is neither a file nor a directory" "$log" >&2
  grep -q -e "No space left on device" -e "Errno 28" "$log" &&
    give_up "the disk filled while installing sglang into $VENV (it had $free GB free before)"
  exit 1
fi
touch "$VENV/.installed"
