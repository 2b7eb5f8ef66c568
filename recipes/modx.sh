#!/usr/bin/env bash
# Mod-X's protocols (Mod-X paper §5, Tables 2-4 and appendix B.7) and its rotation analysis:
#   coco-f30k  CLIP_0 on COCO (the stream's first task), then Flickr30K in 5 random parts;
#              RN50 from random initialisation; benchmarks COCO(5K), Flickr30K(1K)
#   ec         EC-T2I in 5 random parts from OpenAI ViT-B/32 (--weights), lr 1e-6
#   cc12m      CC12M in 10 parts of 1M (STREAMS/cc12m built with `cvl build-stream cc12m`)
# Each setting: seqft, EWC, LwF, DER, Mod-X and joint; one comparison table per setting
# (OUT/SETTING/compare/compare.md) and SAM / RAM / ImAV of seqft vs Mod-X
# (OUT/SETTING/runs/seqft/analysis/).
#   recipes/modx.sh --data data --streams streams --weights ViT-B-32.pt --nproc 8 --out modx-out
# Smoke (CPU): the same protocol streams (`cvl build-stream protocol`: 6, 5 and 10 tasks, the
# COCO / Flickr30K / EC benchmarks) composed from synthetic stand-ins for COCO, Flickr30K, EC
# and CC12M (160 pairs each); tiny RN CLIP, 1 epoch; the EC setting starts from a tiny CLIP_0
# trained on a synthetic pretraining set (standing in for the OpenAI weights); every method in
# coco-f30k, seqft and Mod-X (the rotation analysis's pair) in ec and cc12m (the other methods
# train the same way on every stream, from an --init-run as in DKR's smoke).
#   recipes/modx.sh --smoke --out modx-smoke
# Hyperparameters: recipes/configs/modx.yaml, modx-ec.yaml (smoke: configs/smoke.yaml).
# DER's buffer (not given by the paper): 1,000 pairs (smoke 4).
#
# Common options (recipes/lib.sh):
source "$(dirname "$0")/lib.sh"
parse_args "$@"
OUT=${OUT:-modx-out}
ALL="seqft ewc lwf der modx joint"
METHODS=${METHODS:-$ALL} SETTINGS=${SETTINGS:-"coco-f30k ec cc12m"}
check_choices method "$METHODS" "$ALL"
check_choices setting "$SETTINGS" "coco-f30k ec cc12m"
BUF=1000
[ "$SMOKE" = 1 ] && BUF=4
args_of() {
  case "$1" in
    seqft | ewc | lwf | modx | joint) echo "--method $1" ;;
    der) echo "--method der --buffer reservoir --buffer-size $BUF" ;;
    *) echo "error: unknown method '$1' for modx.sh" >&2; exit 2 ;;
  esac
}
if [ "$SMOKE" = 1 ]; then
  CFG="$RECIPES/configs/smoke.yaml" CFG_EC="$RECIPES/configs/smoke.yaml"
  step "synthetic stand-ins for COCO, Flickr30K, EC, CC12M (+ a pretraining set)"
  smoke_sources "$OUT/sources" 160 128 coco flickr30k ec cc12m
  SRC=(--streams "$OUT/sources")
else
  CFG="$RECIPES/configs/modx.yaml" CFG_EC="$RECIPES/configs/modx-ec.yaml"
  SRC=(--data "$DATA" --streams "$STREAMS")
  [[ " $SETTINGS " == *" ec "* ]] && need_weights "the ec setting starts from OpenAI ViT-B/32"
fi
for S in $SETTINGS; do
  D="$OUT/$S" STREAM="$OUT/$S/stream" C=$CFG INIT=()
  mkdir -p "$D"
  step "$S: build the protocol stream"
  build_stream "$STREAM" protocol "modx-$S" "${SRC[@]}" --seed "$SEED" --out "$STREAM"
  if [ "$S" = ec ]; then
    C=$CFG_EC
    if [ "$SMOKE" = 1 ]; then
      step "$S: CLIP_0 on the pretraining set (stands in for the OpenAI weights)"
      train "$CFG" "$D/runs/clip0" --stream "$OUT/sources/_all/pretrain" --method seqft
      INIT=(--init-run "$D/runs/clip0")
    else
      INIT=(--pretrained "$WEIGHTS")
    fi
  fi
  M=$METHODS
  [ "$S" != coco-f30k ] && M=$(smoke_subset coco-f30k "seqft modx")
  METHODS=$M train_and_compare "$S: " "$C" "$D" "$STREAM" "$S" ${INIT[@]+"${INIT[@]}"}
  if [[ " $M " == *" seqft "* && " $M " == *" modx "* && "$NODE_RANK" -eq 0 ]]; then
    step "$S: rotation analysis (SAM / RAM / ImAV), seqft vs Mod-X"
    "$CVL" analyze rotation --compare "$D/runs/seqft" "$D/runs/modx" --quiet
  fi
done
step "done: $OUT/*/compare/compare.md"
