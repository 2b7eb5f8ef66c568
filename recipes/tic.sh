#!/usr/bin/env bash
# TiC-CLIP's protocol (Garg et al., ICLR 2024): time-ordered web data, one training step per
# period from the previous step's weights (a fresh optimizer, short warm-up), the SAME compute
# per step for every method (--budget samples=C/task), evaluated on every period's retrieval set
# (TiC's dynamic retrieval) and summarised as in-distribution / backward / forward transfer
# (compare.md: ID / backward / forward (TiC)). Methods:
#   sequential         only the new period's data (TiC's Sequential)
#   cumulative-all     + every past pair replayed (Cumulative-All)
#   cumulative-equal   + a buffer of D pairs split equally among past periods (Cumulative-Equal)
#   cumulative-exp     + a buffer of D pairs halved per period of age (Cumulative-Exp)
#   oracle             retrained from scratch on everything so far, with t x C (TiC's Oracle)
#   lwf                LwF on the similarity logits (TiC's LwF*: the old model's forward is
#                      extra compute, shown in the TFLOPs column)
#   wise               WiSE-FT interpolation with the previous step (as TiC's sequential Patching)
#   magmax dare dare_ties breadcrumbs slerp tall_masks opcm best_in_time cclip lora_per_task
#   moe_adapters       issue 38's merges and methods, each on the sequential policy
# Full protocol (TiC-DataComp, 2014-2016 as the first step then one step a year to 2022, 7 steps,
# 9 yearly retrieval sets): the stream STREAMS/tic-datacomp built as datasets/tic-datacomp.md
# says, or built here from DATA/tic-datacomp/metadata.parquet (uid, url, caption, timestamp)
# and, when present, DATA/tic-datacomp/retrieval_evals_year2uids.json (TiC's retrieval uids):
#   recipes/tic.sh --data data --nproc 8 --out tic-out
# Hyperparameters: recipes/configs/tic.yaml (TiC-DataComp medium: ViT-B-32, batch 4096,
# C = 4096 x 4500 samples per step); BUFFER (D, pairs) [TIC_BUFFER env, default 2,000,000].
# Smoke (CPU, about a minute): a drifting synthetic stream (`build-stream synthetic --mode time`:
# 3 steps, the first merging 2 yearly periods), tiny CLIP from random weights, C = 48 samples,
# TiC's five policies (sequential, the three cumulative ones, oracle; --methods for more):
#   recipes/tic.sh --smoke --out tic-smoke
# --synthetic: the docs' table, docs/results.md (one seed per call, --seed N): the drifting synthetic stream
# of 6 yearly periods (2014-2016 merged: 4 steps), 3,600 pairs a period, C = 4,800 samples a
# step (1.3 passes over a period's pairs, as TiC-DataComp-medium's 18.4M samples over a year),
# D = 3,600 (a period's pairs, TiC's D), 100 retrieval pairs a period
# (configs/tic-synthetic.yaml); then recipes/seeds_table.py OUT sequential,... --tic.
#
# Common options (recipes/lib.sh):
SYNTH=0
args=()
for a in "$@"; do
  if [ "$a" = --synthetic ]; then SYNTH=1; else args+=("$a"); fi
done
source "$(dirname "$0")/lib.sh"
parse_args ${args[@]+"${args[@]}"}
OUT=${OUT:-tic-out}
# issue 38's merges and methods on the time-ordered stream (the sequential policy, no buffer)
NEWER="magmax dare dare_ties breadcrumbs slerp tall_masks opcm best_in_time cclip lora_per_task moe_adapters"
ALL="sequential cumulative-all cumulative-equal cumulative-exp oracle lwf wise $NEWER"
POLICIES="sequential cumulative-all cumulative-equal cumulative-exp oracle"
[ "$SMOKE" = 1 ] && METHODS=${METHODS:-$POLICIES}  # the smoke: TiC's policies only (CI time)
METHODS=${METHODS:-$ALL}
check_choices method "$METHODS" "$ALL"
check_choices setting "$SETTINGS" "yearly"  # one setting
if [ "$SMOKE" = 1 ]; then
  CFG="$RECIPES/configs/smoke.yaml" BUF=48 C=48 EXTRA=(--epochs 20)
elif [ "$SYNTH" = 1 ]; then
  CFG="$RECIPES/configs/tic-synthetic.yaml" BUF=3600 C=4800 EXTRA=()
  EVAL_EXTRA=(--no-probe --no-zeroshot)
else
  CFG="$RECIPES/configs/tic.yaml" BUF=${TIC_BUFFER:-2000000} C=$((4096 * 4500)) EXTRA=()
fi
args_of() {
  case "$1" in
    sequential) echo "--method seqft" ;;
    cumulative-all) echo "--method seqft --buffer cumulative-all" ;;
    cumulative-equal | cumulative-exp) echo "--method seqft --buffer $1 --buffer-size $BUF" ;;
    oracle) echo "--method joint --method-arg cumulative=true --method-arg restart=true" ;;
    lwf) echo "--method lwf --method-arg variant=logits" ;;
    wise) echo "--method wise" ;;
    cclip | lora_per_task) echo "--method $1 --tune lora" ;;
    magmax | dare | dare_ties | breadcrumbs | slerp | tall_masks | opcm | best_in_time | moe_adapters) echo "--method $1" ;;
    *) echo "error: unknown method '$1' for tic.sh" >&2; exit 2 ;;
  esac
}
mkdir -p "$OUT"
STREAM="$OUT/stream"
step "build the time-ordered stream"
if [ "$SMOKE" = 1 ]; then
  build_stream "$STREAM" synthetic --mode time --tasks 3 --first-periods 2 --per-task 48 \
    --test-per-task 16 --seed "$SEED" --out "$STREAM" --quiet
elif [ "$SYNTH" = 1 ]; then
  build_stream "$STREAM" synthetic --mode time --tasks 4 --first-periods 3 --per-task 3600 \
    --test-per-task 100 --seed "$SEED" --out "$STREAM" --quiet
elif [ -f "$STREAMS/tic-datacomp/stream.json" ]; then
  STREAM="$STREAMS/tic-datacomp"
else
  META=$(ls "$DATA"/tic-datacomp/metadata.{parquet,csv,tsv,jsonl} 2>/dev/null | head -1 || true)
  [ -n "$META" ] || { echo "error: no $STREAMS/tic-datacomp and no $DATA/tic-datacomp/metadata.* (datasets/tic-datacomp.md)" >&2; exit 2; }
  EVAL=(--test 1000)
  IDS="$DATA/tic-datacomp/retrieval_evals_year2uids.json"
  [ -f "$IDS" ] && EVAL=(--eval-ids "$IDS")
  build_stream "$STREAM" table --input "$META" --id-col uid --url-col url --caption-col caption \
    --time-col timestamp --first-until 2016 --until 2022 "${EVAL[@]}" --seed "$SEED" --out "$STREAM"
fi
INIT=()
[ -n "$WEIGHTS" ] && INIT=(--pretrained "$WEIGHTS")
train_and_compare "" "$CFG" "$OUT" "$STREAM" yearly --budget "samples=$C/task" \
  ${EXTRA[@]+"${EXTRA[@]}"} ${INIT[@]+"${INIT[@]}"}
step "done: $OUT/compare/compare.md"
