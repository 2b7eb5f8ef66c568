#!/usr/bin/env bash
# The embedded default job (`make demo`): the papers' regime on the built-in synthetic stream.
#
#   1. build a 5-task stream whose neighbouring tasks share vocabulary, plus a broad
#      pretraining stream (all domains);
#   2. train CLIP_0 on the pretraining stream once (every paper starts from a trained model);
#   3. from CLIP_0: zero-shot, seqft, ER and the five paper methods (Mod-X, DKR, DHA, CTP,
#      IncCLIP), tiny RN CLIP on the CPU;
#   4. evaluate all of them in one process and print one comparison table;
#   5. Mod-X's rotation analysis (SAM / RAM / ImAV) of seqft vs Mod-X.
#
# Usage: recipes/demo.sh [OUT_DIR]   (METHODS="seqft modx" to choose the methods: any
#        `cvl methods` name, er, dha-dagger, NAME+MODE for `--tune MODE` (seqft+lora),
#        NAME-lrX for `--lr X` (seqft+lora-lr5e-3), lora_per_task-task (route=task);
#        SEED=N; sizes PER_TASK=250 pairs per task,
#        PRETRAIN=1500 pretraining pairs, TEST=100 test pairs per task;
#        BUDGET=SPEC trains every method to that `cvl train --budget` into runs/METHOD-budget
#        (docs/compute.md: Comparing at equal compute);
#        recipes/synthetic_benchmark.sh runs it over 3 seeds with 600 / 2000 / 128)
# Rerunning reuses what is finished (stream, runs, evaluations). What was traded for the
# 5-minute budget (against recipes/synthetic_methods.sh): 250 pairs per task and 2 epochs
# (instead of 1,000-2,000 and 4), 100 test pairs per task, no linear probe or zero-shot
# classification in the evaluation, comparison curves instead of every run's heatmaps
# (`cvl eval --run RUN` writes a run's own plots from the evaluation cache). Every method
# keeps its paper defaults.
set -euo pipefail
OUT=${1:-demo-out}
CVL=${CVL:-.venv/bin/cvl}
METHODS=${METHODS:-"seqft er modx dkr dha ctp incclip"}
SEED=${SEED:-0}
PER_TASK=${PER_TASK:-250}
PRETRAIN=${PRETRAIN:-1500}
TEST=${TEST:-100}
BUDGET=${BUDGET:-}
SUFFIX=${BUDGET:+-budget}  # budgeted runs sit beside the unbudgeted ones
BUF=$((PER_TASK / 4))      # replay: 5 % of the stream's 5 x PER_TASK pairs
MEM=$((PER_TASK / 2))      # IncCLIP's memory: 10 %
# ZSCL's weight ensemble every ~10 % of a task (ZSCL.sh: every 100 of 1,000 iterations):
# 2 epochs of PER_TASK / 64 steps each
ZSCL_WE=$(((2 * (PER_TASK / 64) + 5) / 10))
ZSCL_WE=$((ZSCL_WE > 0 ? ZSCL_WE : 1))
mkdir -p "$OUT"
t_start=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - t_start )) s] $* =="; }

STREAM="$OUT/stream"
step "1. build the synthetic stream (5 tasks; neighbouring tasks share 3 of 4 shapes and a style) + pretraining set"
if [ -f "$STREAM/stream.json" ]; then
  echo "reusing $STREAM"
else
  "$CVL" build-stream synthetic --out "$STREAM" --tasks 5 --per-task "$PER_TASK" \
    --pretrain "$PRETRAIN" --test-per-task "$TEST" --val-per-task 50 --query-per-task 30 --gallery-per-task 100 \
    --seed "$SEED"
fi

COMMON=(--model clip --model-config tiny --batch-size 64 --seed "$SEED" --log-with none)
step "2. CLIP_0: train on the pretraining stream ($STREAM/pretrain)"
"$CVL" train --stream "$STREAM/pretrain" --method seqft --epochs 3 "${COMMON[@]}" \
  --out "$OUT/runs/clip0"

args_of() {  # the method's CLI arguments (paper defaults; replay 5 % of the stream, IncCLIP 10 %)
  case "$1" in
    *-lr*) echo "$(args_of "${1%-lr*}") --lr ${1##*-lr}" ;;  # NAME-lrX: with --lr X (5e-3, ...)
    *+*) echo "$(args_of "${1%%+*}") --tune ${1#*+}" ;;  # NAME+MODE: with --tune MODE (lora, ...)
    lora_per_task-task) echo "--method lora_per_task --method-arg route=task" ;;  # oracle routing
    er) echo "--method seqft --buffer reservoir --buffer-size $BUF" ;;
    dha) echo "--method dha --buffer ring --buffer-size $BUF" ;;
    dha-dagger) echo "--method dha" ;;  # DHA without its buffer (DHA† in the paper)
    icarl | lucir) echo "--method $1 --buffer mof --buffer-size $BUF" ;;  # herding buffer, as ER
    incclip) echo "--method incclip --buffer reservoir --buffer-size $MEM" ;;
    der | co2l | erl) echo "--method $1 --buffer reservoir --buffer-size $BUF" ;;
    derpp) echo "--method der --method-arg derpp=true --buffer reservoir --buffer-size $BUF" ;;
    zscl) echo "--method zscl --method-arg ref_stream=$STREAM/pretrain --method-arg we_every=$ZSCL_WE" ;;  # teacher: CLIP_0
    *) echo "--method $1" ;;
  esac
}
RUNS=("$OUT/runs/zeroshot")
step "3. zero-shot: CLIP_0 on every task"
"$CVL" train --stream "$STREAM" --method zeroshot --init-run "$OUT/runs/clip0" "${COMMON[@]}" \
  --out "$OUT/runs/zeroshot" --quiet
for M in $METHODS; do
  step "3. train $M from CLIP_0 (5 tasks, 2 epochs each${BUDGET:+ at most, budget $BUDGET})"
  # shellcheck disable=SC2046
  "$CVL" train --stream "$STREAM" $(args_of "$M") --init-run "$OUT/runs/clip0" --epochs 2 \
    "${COMMON[@]}" ${BUDGET:+--budget "$BUDGET"} --out "$OUT/runs/$M$SUFFIX"
  RUNS+=("$OUT/runs/$M$SUFFIX")
done

step "4. evaluate and compare: ${METHODS}"
"$CVL" eval --compare "${RUNS[@]}" --no-probe --no-zeroshot --out "$OUT/compare$SUFFIX"

if [[ -z "$BUDGET" && " $METHODS " == *" seqft "* && " $METHODS " == *" modx "* ]]; then
  step "5. Mod-X rotation analysis: seqft vs modx (first task's test set)"
  "$CVL" analyze rotation --compare "$OUT/runs/seqft" "$OUT/runs/modx"
fi

step "done in $(( $(date +%s) - t_start )) s; files written"
cat <<EOF
  $STREAM/stream.json              the stream (and $STREAM/pretrain/, the pretraining set)
  $OUT/runs/clip0/                 CLIP_0, the start of every method
  $OUT/runs/METHOD/tasks/NN-*/     one checkpoint per task (safetensors) and its train log
  $OUT/runs/METHOD/eval/           summary.md, metrics.json, CSV tables (heatmaps and curves:
                                   cvl eval --run $OUT/runs/METHOD, reusing the cache)
  $OUT/compare/                    compare.md / .csv: the table above; compare_Rm.png and
                                   compare_TR1.png: each run's score on the tasks seen so far
  $OUT/runs/seqft/analysis/        rotation tables and plots (SAM / RAM / ImAV)
EOF
