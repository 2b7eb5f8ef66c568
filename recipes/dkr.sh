#!/usr/bin/env bash
# DKR's two settings (DKR paper §5, Tables 1-2), from OpenAI CLIP ViT-B/32 (--weights):
#   s1  COCO -> Flickr30K -> IAPR TC-12 -> EC -> RSICD (DKR λ = 1)
#   s2  EC in 5 random parts; benchmarks Flickr30K(1K), COCO(5K), EC(5K) (DKR λ = 0.1)
# Runs joint, zero-shot, SFT (seqft), EWC, LwF, ERL, AFC, Mod-X and DKR; one comparison table
# per setting (OUT/SETTING/compare/compare.md).
#   recipes/dkr.sh --data data --weights ViT-B-32.pt --nproc 8 --out dkr-out
# Smoke (CPU): synthetic streams of 5 tasks each, tiny RN CLIP, 1 epoch, starting from a tiny
# CLIP_0 trained on a synthetic pretraining set (standing in for the OpenAI weights).
#   recipes/dkr.sh --smoke --out dkr-smoke
# Hyperparameters: recipes/configs/dkr.yaml (smoke: configs/smoke.yaml). ERL's exemplar
# buffer (not given by the paper): 2,000 pairs (smoke 4).
#
# Common options (recipes/lib.sh):
source "$(dirname "$0")/lib.sh"
parse_args "$@"
OUT=${OUT:-dkr-out}
METHODS=${METHODS:-"joint zeroshot seqft ewc lwf erl afc modx dkr"}
SETTINGS=${SETTINGS:-"s1 s2"}
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
for S in $SETTINGS; do
  case "$S" in s1 | s2) ;; *) echo "error: unknown setting '$S' (s1, s2)" >&2; exit 2 ;; esac
  D="$OUT/$S" STREAM="$OUT/$S/stream"
  mkdir -p "$D"
  if [ "$SMOKE" = 1 ]; then
    CFG="$RECIPES/configs/smoke.yaml"
    step "$S: build the synthetic stream (5 tasks) and a pretraining set"
    build_stream "$STREAM" synthetic --out "$STREAM" --tasks 5 --per-task 48 --pretrain 128 \
      --test-per-task 24 --val-per-task 8 --query-per-task 8 --gallery-per-task 16 \
      --seed "$SEED" --quiet
    step "$S: CLIP_0 on the pretraining set (stands in for the OpenAI weights)"
    train "$CFG" "$D/runs/clip0" --stream "$STREAM/pretrain" --method seqft
    INIT=(--init-run "$D/runs/clip0")
  else
    CFG="$RECIPES/configs/dkr.yaml"
    [ -n "$WEIGHTS" ] || { echo "error: DKR starts from OpenAI ViT-B/32: give --weights FILE" >&2; exit 2; }
    INIT=(--pretrained "$WEIGHTS")
    step "$S: build the protocol stream"
    build_stream "$STREAM" protocol "dkr-$S" --data "$DATA" --seed "$SEED" --out "$STREAM"
  fi
  RUNS=()
  for M in $METHODS; do
    step "$S: train $M"
    # shellcheck disable=SC2046
    train "$CFG" "$D/runs/$M" --stream "$STREAM" $(args_of "$M" "$S") "${INIT[@]}"
    RUNS+=("$D/runs/$M")
  done
  step "$S: evaluate and compare"
  # shellcheck disable=SC2046
  compare "$D/compare" $(eval_opts) -- "${RUNS[@]}"
done
step "done: $OUT/*/compare/compare.md"
