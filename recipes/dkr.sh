#!/usr/bin/env bash
# DKR's two settings (DKR paper §5, Tables 1-2), from OpenAI CLIP ViT-B/32 (--weights):
#   s1  COCO -> Flickr30K -> IAPR TC-12 -> EC -> RSICD (DKR λ = 1)
#   s2  EC in 5 random parts; benchmarks Flickr30K(1K), COCO(5K), EC(5K) (DKR λ = 0.1)
# Runs joint, zero-shot, SFT (seqft), EWC, LwF, ERL, AFC, Mod-X and DKR; one comparison table
# per setting (OUT/SETTING/compare/compare.md).
#   recipes/dkr.sh --data data --weights ViT-B-32.pt --nproc 8 --out dkr-out
# Smoke (CPU): the same protocol streams (`cvl build-stream protocol dkr-s1|dkr-s2`, 5 tasks
# each, s2 with its three benchmarks) from synthetic stand-ins for COCO, Flickr30K, IAPR, EC
# and RSICD; tiny RN CLIP, 1 epoch, starting from a tiny CLIP_0 trained on a synthetic
# pretraining set (standing in for the OpenAI weights); every method in s1, SFT and DKR (its
# λ = 0.1) in s2 (the other methods train the same way on either stream).
#   recipes/dkr.sh --smoke --out dkr-smoke
# Hyperparameters: recipes/configs/dkr.yaml (smoke: configs/smoke.yaml). ERL's exemplar
# buffer (not given by the paper): 2,000 pairs (smoke 4).
#
# Common options (recipes/lib.sh):
source "$(dirname "$0")/lib.sh"
parse_args "$@"
OUT=${OUT:-dkr-out}
ALL="joint zeroshot seqft ewc lwf erl afc modx dkr"
METHODS=${METHODS:-$ALL} SETTINGS=${SETTINGS:-"s1 s2"}
check_choices method "$METHODS" "$ALL"
check_choices setting "$SETTINGS" "s1 s2"
BUF=2000
[ "$SMOKE" = 1 ] && BUF=4
args_of() {  # $1 method, $2 setting
  case "$1" in
    joint | zeroshot | seqft | ewc | lwf | afc | modx) echo "--method $1" ;;
    erl) echo "--method erl --buffer reservoir --buffer-size $BUF" ;;
    dkr) if [ "$2" = s2 ]; then echo "--method dkr --method-arg lam=0.1"; else echo "--method dkr"; fi ;;
    *) echo "error: unknown method '$1' for dkr.sh" >&2; exit 2 ;;
  esac
}
if [ "$SMOKE" = 1 ]; then
  CFG="$RECIPES/configs/smoke.yaml"
  step "synthetic stand-ins for COCO, Flickr30K, IAPR, EC, RSICD (+ a pretraining set)"
  smoke_sources "$OUT/sources" 96 128 coco flickr30k iapr ec rsicd
  SRC=(--streams "$OUT/sources")
  step "CLIP_0 on the pretraining set (stands in for the OpenAI weights)"
  train "$CFG" "$OUT/clip0" --stream "$OUT/sources/_all/pretrain" --method seqft
  INIT=(--init-run "$OUT/clip0")
else
  CFG="$RECIPES/configs/dkr.yaml"
  need_weights "DKR starts from OpenAI ViT-B/32"
  SRC=(--data "$DATA" --streams "$STREAMS")
  INIT=(--pretrained "$WEIGHTS")
fi
for S in $SETTINGS; do
  D="$OUT/$S" STREAM="$OUT/$S/stream"
  mkdir -p "$D"
  step "$S: build the protocol stream"
  build_stream "$STREAM" protocol "dkr-$S" "${SRC[@]}" --seed "$SEED" --out "$STREAM"
  M=$METHODS
  [ "$S" = s2 ] && M=$(smoke_subset s1 "seqft dkr")
  METHODS=$M train_and_compare "$S: " "$CFG" "$D" "$STREAM" "$S" "${INIT[@]}"
done
step "done: $OUT/*/compare/compare.md"
