#!/usr/bin/env bash
# CTP's P9D protocol (CTP paper Table 1 and appendix Table 7), the ALBEF-style fusion model:
# 9 industries in the default and the reversed order; JointT, SeqF and the memory-free
# methods (EWC, SI, MAS, AFEC, RWalk, LwF, CTP) and the memory-buffer ones (ER, MoF, Kmeans,
# iCaRL, LUCIR, CTP+ER; a 10,000-pair buffer); cross-modal TR/IR@1/5/10, Rm and multi-modal
# mAP@1/5/10 on the seen tasks' test sets in one table per order
# (OUT/ORDER/compare/compare.md).
#   recipes/ctp_p9d.sh --data P9D --model-config fusion-ctp.json --nproc 8 --out ctp-out
# DATA holds P9D's json/ (train, test, query, gallery) and its images; the model config is a
# JSON extending `base` with the local DeiT-B/16 file and bert-base-chinese folder.
# Smoke (CPU): 9 synthetic tasks named after P9D's industries (16 training pairs each: 2
# steps a task), with test, query and gallery sets, in the default and the reversed order;
# tiny fusion model (10 % warm-up, as recipes/synthetic_methods.sh), 1 epoch; every method of
# Table 1 in the default order, SeqF, CTP and CTP+ER in the reversed one (the reversed stream,
# its evaluation and table; the other methods train the same way in either order).
#   recipes/ctp_p9d.sh --smoke --out ctp-smoke
# Hyperparameters: recipes/configs/ctp_p9d.yaml (smoke: configs/smoke.yaml).
#
# Common options (recipes/lib.sh):
source "$(dirname "$0")/lib.sh"
parse_args "$@"
OUT=${OUT:-ctp-out}
ALL="joint seqft ewc si mas afec rwalk lwf ctp er mof kmeans icarl lucir ctp-er"
METHODS=${METHODS:-$ALL} SETTINGS=${SETTINGS:-"default reversed"}
check_choices method "$METHODS" "$ALL"
check_choices setting "$SETTINGS" "default reversed"
if [ "$SMOKE" = 1 ]; then
  CFG="$RECIPES/configs/smoke.yaml" BUF=8
  SMOKE_ARGS=(--model fusion --model-config tiny --warmup 0.1)
else
  CFG="$RECIPES/configs/ctp_p9d.yaml" BUF=10000
  SMOKE_ARGS=()
fi
args_of() {
  case "$1" in
    joint | seqft | ewc | si | mas | afec | rwalk | lwf | ctp) echo "--method $1" ;;
    er) echo "--method seqft --buffer reservoir --buffer-size $BUF" ;;
    mof | kmeans) echo "--method seqft --buffer $1 --buffer-size $BUF" ;;
    icarl | lucir) echo "--method $1 --buffer mof --buffer-size $BUF" ;;
    ctp-er) echo "--method ctp --buffer reservoir --buffer-size $BUF" ;;
    *) echo "error: unknown method '$1' for ctp_p9d.sh" >&2; exit 2 ;;
  esac
}
INDUSTRIES=(Household Furnishings Food Beauty Clothing Auto Parenting Outdoor Electronics)
for S in $SETTINGS; do
  D="$OUT/$S" STREAM="$OUT/stream-$S"
  mkdir -p "$D"
  step "$S order: build the stream"
  if [ "$SMOKE" = 1 ]; then
    ALL="$OUT/sources/_all"
    build_stream "$ALL" synthetic --out "$ALL" --tasks 9 --per-task 16 --test-per-task 16 \
      --val-per-task 4 --query-per-task 8 --gallery-per-task 16 --seed "$SEED" --quiet
    ORDER=(0 1 2 3 4 5 6 7 8)
    [ "$S" = reversed ] && ORDER=(8 7 6 5 4 3 2 1 0)
    TASKS=()
    for i in "${ORDER[@]}"; do TASKS+=(--task "${INDUSTRIES[$i]}=$ALL:task=t$i"); done
    build_stream "$STREAM" compose "${TASKS[@]}" --out "$STREAM"
  else
    build_stream "$STREAM" p9d --annotations "$DATA/json" --images "$DATA" --order "$S" \
      --seed "$SEED" --out "$STREAM"
  fi
  M=$METHODS
  [ "$S" = reversed ] && M=$(smoke_subset default "seqft ctp ctp-er")
  METHODS=$M train_and_compare "$S order: " "$CFG" "$D" "$STREAM" "$S" \
    ${SMOKE_ARGS[@]+"${SMOKE_ARGS[@]}"}
done
step "done: $OUT/*/compare/compare.md"
