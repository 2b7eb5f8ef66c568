#!/usr/bin/env bash
# The embedded default job (`make demo`): synthetic stream -> train -> eval, on a laptop CPU.
# Usage: recipes/demo.sh [OUT_DIR]   (METHODS="seqft joint modx" to choose the methods)
# Default: seqft and modx, each evaluated, compared side by side, and their Mod-X rotation
# analysis (SAM / RAM tables) compared. About 5 minutes on 2 CPU cores.
set -euo pipefail
OUT=${1:-demo-out}
CVL=${CVL:-.venv/bin/cvl}
METHODS=${METHODS:-"seqft modx"}
mkdir -p "$OUT"

has() { "$CVL" --help | grep -qE "^  $1 "; }

echo "== 1. build the synthetic stream (5 tasks) =="
if [ -f "$OUT/stream/stream.json" ]; then
  echo "reusing $OUT/stream"
else
  "$CVL" build-stream synthetic --out "$OUT/stream" --tasks 5 --per-task 1000 --first-task 2000 --seed 0
fi
"$CVL" info "$OUT/stream"

if ! has train; then
  echo "== training is not available in this version yet (cvl train): stopping after the stream =="
  exit 0
fi
for M in $METHODS; do
  echo "== 2. train: $M (tiny CLIP, CPU) =="
  "$CVL" train --stream "$OUT/stream" --method "$M" --model clip --model-config tiny \
    --epochs 4 --batch-size 64 --out "$OUT/runs/$M"
done

if ! has eval; then
  echo "== evaluation is not available in this version yet (cvl eval) =="
  exit 0
fi
RUNS=()
for M in $METHODS; do
  echo "== 3. evaluate: $M =="
  "$CVL" eval --run "$OUT/runs/$M"
  RUNS+=("$OUT/runs/$M")
done
if [ ${#RUNS[@]} -gt 1 ]; then
  echo "== 4. compare: ${METHODS} =="
  "$CVL" eval --compare "${RUNS[@]}"
  echo "== 5. Mod-X rotation analysis: ${RUNS[0]##*/} vs ${RUNS[1]##*/} (first task's test set) =="
  "$CVL" analyze rotation --compare "${RUNS[0]}" "${RUNS[1]}"
fi
