#!/usr/bin/env bash
# The suite's live step (bench/gpu_suite.sh) for this tree and for an older one, alternating on one host, so a
# change's effect on live conversations is measured side by side (docs/performance.md: the lent hosts differ,
# only same-run comparisons count):
#
#   mkdir old && git archive REV | tar x -C old     # here, before the device call: the folder travels with the
#                                                   # working tree (remove it after: `ruff check .` would read it)
#   bash bench/live_ab.sh old OUT_DIR [MODEL_DIR]
#
#   OLD_EXTRA='--service-flags all=--read-ahead=1' bash bench/live_ab.sh . OUT_DIR   # or one tree, two flag sets
#
# ROUNDS (2) rounds of: this tree, then the older one, each with a fresh orchestrator and services; NEW_EXTRA
# and OLD_EXTRA are service flags added to each side's live configuration (the suite's EXTRA_SERVE_FLAGS), so
# OLD_TREE may be this tree itself and the sides differ by their flags. Each run's
# files go to OUT_DIR/new-N and OUT_DIR/old-N; at the end every run's client line (window, intervals) is printed
# in order, and OUT_DIR is packed into OUT_DIR.tgz (a device call brings back only a few files). MODEL_DIR as the
# suite's (generated when missing). The suite's knobs apply to both trees; here PACES defaults to burst and
# COUNTS to SESSIONS (16), MPS to 1. An older tree's suite may not know every knob (COUNTS came later: it then
# runs 16 and 1 conversations).
set -uo pipefail
old=${1:?usage: bash bench/live_ab.sh OLD_TREE OUT_DIR [MODEL_DIR]}
out=${2:?usage: bash bench/live_ab.sh OLD_TREE OUT_DIR [MODEL_DIR]}
model=${3:-/tmp/voicechat-full4}
[ -f "$old/bench/gpu_suite.sh" ] || { echo "error: $old/bench/gpu_suite.sh not found: OLD_TREE is a checkout" >&2; exit 1; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
old=$(cd "$old" && pwd)
export STEPS=live PACES=${PACES:-burst} COUNTS=${COUNTS:-${SESSIONS:-16}} MPS=${MPS:-1}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in new old; do
    tree=$PWD
    [ $side = old ] && tree=$old
    echo "== $(date +%T) round $round: $side ($tree)"
    extra=${NEW_EXTRA:-}
    [ $side = old ] && extra=${OLD_EXTRA:-}
    (cd "$tree" && EXTRA_SERVE_FLAGS=$extra bash bench/gpu_suite.sh "$out/$side-$round" "$model") \
      > "$out/$side-$round.log" 2>&1 \
      || echo "== $side-$round failed (log: $out/$side-$round.log)"
  done
done
for run in "$out"/*-*/; do
  for steps in "$run"*.steps.txt; do
    [ -f "$steps" ] && echo "$(basename "$run") $(basename "$steps" .steps.txt): $(head -n 1 "$steps")"
  done
done
rm -f "$out"/*/*.metrics
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && echo "== packed $out.tgz"
