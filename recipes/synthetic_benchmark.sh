#!/usr/bin/env bash
# The built-in benchmark in the papers' regime, over seeds: `recipes/demo.sh` (stream with
# shared vocabulary between neighbouring tasks, CLIP_0 trained on the pretraining set, every
# method started from it) for each seed, then mean ± sd of the headline numbers.
# Usage: recipes/synthetic_benchmark.sh [OUT_DIR] [SEEDS]     (default: bench "0 1 2")
# The results tables (docs/results.md) are this script's output. BUDGET=SPEC (e.g. tflops=0.166, SeqF's
# two epochs) trains every method to that `--budget` instead (runs METHOD-budget, reusing each
# seed's stream and CLIP_0) and adds each run's TFLOPs and steps to the table.
set -euo pipefail
OUT=${1:-bench}
SEEDS=${2:-"0 1 2"}
PY=${PY:-.venv/bin/python}
# the paper methods and bounds (issue 12's table), then CTP Table 1's baselines
export METHODS=${METHODS:-"seqft joint er modx dkr dha-dagger dha ctp incclip ewc si mas rwalk afec lwf icarl lucir"}
for s in $SEEDS; do
  PER_TASK=${PER_TASK:-600} PRETRAIN=${PRETRAIN:-2000} TEST=${TEST:-128} SEED=$s \
    bash "$(dirname "$0")/demo.sh" "$OUT/s$s"
done
if [ -n "${BUDGET:-}" ]; then
  "$PY" "$(dirname "$0")/seeds_table.py" "$OUT" "${METHODS// /-budget,}-budget" --cost
else
  "$PY" "$(dirname "$0")/seeds_table.py" "$OUT" "zeroshot,${METHODS// /,}"
fi
