#!/usr/bin/env bash
# Every method of the papers next to the bounds, on the *disjoint* synthetic stream (CPU-sized):
# random initialisation, tasks that share no shape or style (`--overlap 0`), the hard case for
# old-vs-new distillation. The papers' regime (a pretrained start, tasks that share
# vocabulary) is recipes/synthetic_benchmark.sh.
# Usage: recipes/synthetic_methods.sh [OUT_DIR] [SEED]      (RUNS="seqft modx" to choose;
#        variants: modx-mean, incclip-tau0, ctp-fusion-nomoco, lwf-logits, lwf-fusion,
#        lucir-fusion; CTP Table 1 baselines: ewc si mas rwalk afec lwf icarl lucir)
# 5 tasks, 2000 + 4 x 1000 pairs, tiny RN CLIP,
# 4 epochs per task, batch 64); replay sizes: ER / DHA ring 300 pairs (5 % of the stream),
# IncCLIP memory 600 (10 %, as in the paper), iCaRL / LUCIR herding (mof) buffer 300 (as ER).
# Ends with `cvl eval --compare` of all runs.
set -euo pipefail
OUT=${1:-synthetic-methods}
SEED=${2:-0}
CVL=${CVL:-.venv/bin/cvl}
RUNS=${RUNS:-"seqft joint er modx dkr dha-dagger dha ctp incclip seqft-fusion ctp-fusion ewc si mas rwalk afec lwf icarl lucir"}
COMMON=(--epochs 4 --batch-size 64 --seed "$SEED" --log-with none --quiet)

args_of() {
  case "$1" in
    seqft) echo "--method seqft" ;;
    joint) echo "--method joint" ;;
    er) echo "--method seqft --buffer reservoir --buffer-size 300" ;;
    modx) echo "--method modx" ;;
    dkr) echo "--method dkr" ;;
    dha-dagger) echo "--method dha" ;;
    dha) echo "--method dha --buffer ring --buffer-size 300" ;;
    ctp) echo "--method ctp" ;;
    incclip) echo "--method incclip --buffer reservoir --buffer-size 600" ;;
    # fusion runs warm up 10 % of each task: without it the fresh AdamW of a new task knocks
    # the random tiny fusion model back onto its ITC plateau (ln B) and it stops learning
    seqft-fusion) echo "--method seqft --model fusion --warmup 0.1" ;;
    ctp-fusion) echo "--method ctp --model fusion --warmup 0.1" ;;
    # CTP Table 1 baselines (defaults: the CTP code's λ values)
    ewc) echo "--method ewc" ;;
    si) echo "--method si" ;;
    mas) echo "--method mas" ;;
    rwalk) echo "--method rwalk" ;;
    afec) echo "--method afec" ;;
    lwf) echo "--method lwf" ;;
    icarl) echo "--method icarl --buffer mof --buffer-size 300" ;;
    lucir) echo "--method lucir --buffer mof --buffer-size 300" ;;
    # variants (not in the default RUNS): what limits a method on this short stream
    modx-mean) echo "--method modx --method-arg reduction=mean" ;;
    incclip-tau0) echo "--method incclip --buffer reservoir --buffer-size 600 --method-arg tau_old=0" ;;
    ctp-fusion-nomoco) echo "--method ctp --model fusion --warmup 0.1 --method-arg momentum_weight=0" ;;
    lwf-logits) echo "--method lwf --method-arg variant=logits" ;;
    lwf-fusion) echo "--method lwf --model fusion --warmup 0.1" ;;
    lucir-fusion) echo "--method lucir --model fusion --warmup 0.1 --buffer mof --buffer-size 300" ;;
    *) echo "unknown run '$1'" >&2; exit 2 ;;
  esac
}

STREAM="$OUT/stream-s$SEED"
if [ ! -f "$STREAM/stream.json" ]; then
  "$CVL" build-stream synthetic --out "$STREAM" --tasks 5 --per-task 1000 --first-task 2000 \
    --overlap 0 --seed "$SEED"
fi
DONE=()
for R in $RUNS; do
  RUN="$OUT/s$SEED/$R"
  echo "== $R (seed $SEED) =="
  start=$(date +%s)
  # shellcheck disable=SC2046
  "$CVL" train --stream "$STREAM" $(args_of "$R") --model-config "${MODEL_CONFIG:-tiny}" \
    "${COMMON[@]}" --out "$RUN"
  echo "trained in $(( $(date +%s) - start )) s"
  "$CVL" eval --run "$RUN" --quiet > "$RUN.eval.txt"
  DONE+=("$RUN")
done
"$CVL" eval --compare "${DONE[@]}"
