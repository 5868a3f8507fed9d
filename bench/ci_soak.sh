#!/usr/bin/env bash
# Issue 12's CI soak: N clean-clone `.ci/run`s of REV, one after another, while two busy loops
# load the cores; stops at the first failure. Not part of CI (it is CI, N times).
#   bench/ci_soak.sh REV [N] [OUT_DIR]
# Each run prints one line to OUT_DIR/summary: rc, wall seconds, pytest's last line.
set -u
REV=${1:?usage: bench/ci_soak.sh REV [N] [OUT_DIR]}
N=${2:-10}
OUT=${3:-$(mktemp -d /tmp/nvrx-ci-soak-XXXX)}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
(while true; do :; done) & busy1=$!
(while true; do :; done) & busy2=$!
trap 'kill $busy1 $busy2 2>/dev/null' EXIT
for i in $(seq 1 "$N"); do
  clone="$OUT/run-$i"
  rm -rf "$clone"
  git clone -q "$REPO" "$clone" && git -C "$clone" checkout -q "$REV"
  start=$(date +%s)
  (cd "$clone" && CI=true timeout 1500 bash .ci/run) > "$OUT/run-$i.log" 2>&1
  rc=$?
  wall=$(( $(date +%s) - start ))
  echo "run $i rev $REV rc $rc wall $wall s :: $(grep -E 'passed|failed' "$OUT/run-$i.log" | tail -n 1)" | tee -a "$OUT/summary"
  rm -rf "$clone"
  [ "$rc" -eq 0 ] || exit "$rc"
done
