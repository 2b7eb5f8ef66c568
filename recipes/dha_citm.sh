#!/usr/bin/env bash
# DHA's CITM protocol (DHA paper Table 1): COCO -> CC3M -> WIT -> GoodNews, ResNet-50, 15
# epochs, each task ending with its best epoch on val; baseline (seqft), LwF, ER, DER, Co2L,
# DHA (5 % ring buffer) and DHA† (no buffer); R@mean per direction and the forgetting rate
# FR_t = (R_t^t - R_t^n) / R_t^t in one comparison table (compare.md: FR I2T / FR T2I).
#
# Full protocol: the CC3M, WIT and GoodNews streams are built beforehand from their URL lists
# (`cvl build-stream cc3m|wit|goodnews ... --sample 130000 --val 13000 --test 5000`) into
# STREAMS/cc3m, STREAMS/wit, STREAMS/goodnews; COCO comes from DATA/coco.
#   recipes/dha_citm.sh --data data --streams streams --nproc 8 --out dha-out
# Smoke (CPU, minutes): the same protocol stream (`cvl build-stream protocol dha-citm`, 4
# tasks) from synthetic stand-ins for COCO, CC3M, WIT and GoodNews (32 training pairs each);
# tiny RN CLIP, 1 epoch:
#   recipes/dha_citm.sh --smoke --out dha-smoke
# Hyperparameters: recipes/configs/dha_citm.yaml (smoke: configs/smoke.yaml).
# Buffers: 5 % of a task's training set (6,500 of 130k pairs) for ER, DER, Co2L and DHA.
#
# Common options (recipes/lib.sh):
source "$(dirname "$0")/lib.sh"
parse_args "$@"
OUT=${OUT:-dha-out}
ALL="seqft lwf er der co2l dha dha-dagger"
METHODS=${METHODS:-$ALL}
check_choices method "$METHODS" "$ALL"
check_choices setting "$SETTINGS" "citm"  # one setting
if [ "$SMOKE" = 1 ]; then
  CFG="$RECIPES/configs/smoke.yaml" BUF=4
else
  CFG="$RECIPES/configs/dha_citm.yaml" BUF=6500
fi
args_of() {
  case "$1" in
    seqft) echo "--method seqft" ;;  # 'Baseline'
    lwf) echo "--method lwf" ;;
    er) echo "--method seqft --buffer reservoir --buffer-size $BUF" ;;
    der | co2l) echo "--method $1 --buffer reservoir --buffer-size $BUF" ;;
    dha) echo "--method dha --buffer ring --buffer-size $BUF" ;;  # DHA (Alg. 2 ring buffer)
    dha-dagger) echo "--method dha" ;;  # DHA† (no buffer)
    *) echo "error: unknown method '$1' for dha_citm.sh" >&2; exit 2 ;;
  esac
}
mkdir -p "$OUT"
STREAM="$OUT/stream"
step "build the CITM stream"
if [ "$SMOKE" = 1 ]; then
  smoke_sources "$OUT/sources" 32 0 coco cc3m wit goodnews
  SRC=(--streams "$OUT/sources")
else
  SRC=(--data "$DATA" --streams "$STREAMS")
fi
build_stream "$STREAM" protocol dha-citm "${SRC[@]}" --seed "$SEED" --out "$STREAM"
INIT=()
[ -n "$WEIGHTS" ] && INIT=(--pretrained "$WEIGHTS")
train_and_compare "" "$CFG" "$OUT" "$STREAM" citm ${INIT[@]+"${INIT[@]}"}
step "done: $OUT/compare/compare.md"
