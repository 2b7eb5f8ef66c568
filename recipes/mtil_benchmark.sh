#!/usr/bin/env bash
# The synthetic MTIL table (docs/mtil.md): `recipes/mtil.sh --smoke` on a bigger stand-in (4
# datasets of 4 shapes, 32 training / 16 test images per class; a CLIP_0 trained 300 steps of
# batch 32 at lr 2e-3 on a 1,600-image pool of all 16 shapes; 30 steps of batch 16 per task
# at lr 1e-3; the MTIL objective, recipes/configs/mtil-smoke.yaml), every method of the
# recipe, for each seed;
# then mean ± sd over seeds of MTIL's and X-TAIL's Transfer / Avg. / Last (mtil_table.py).
# Usage: recipes/mtil_benchmark.sh [OUT_DIR] [SEEDS]      (default: mtil-bench "0 1 2")
# CVL / PY choose the executables (default: .venv/bin/cvl, .venv/bin/python).
set -euo pipefail
OUT=${1:-mtil-bench}
SEEDS=${2:-"0 1 2"}
PY=${PY:-.venv/bin/python}
HERE=$(dirname "$0")
ALL="zeroshot seqft lwf icarl wise zscl zs_merge ft_merge task_arith ties model_stock ema_merge seqft-lora"
export SMOKE_DATASETS=4 SMOKE_TRAIN=32 SMOKE_TEST=16 SMOKE_PRETRAIN=1600 SMOKE_CLIP0_STEPS=300
export SMOKE_CLIP0_BATCH=32 SMOKE_CLIP0_LR=2e-3 SMOKE_STEPS=30
for s in $SEEDS; do
  bash "$HERE/mtil.sh" --smoke --seed "$s" --methods "${METHODS:-$ALL}" --out "$OUT/s$s"
done
"$PY" "$HERE/mtil_table.py" "$OUT" order1
