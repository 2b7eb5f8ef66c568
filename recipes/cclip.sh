#!/usr/bin/env bash
# C-CLIP's protocol (Liu et al., "C-CLIP: Multimodal Continual Learning for Vision-Language
# Model", ICLR 2025): a pretrained CLIP trained on eight caption datasets in turn — Flickr30K,
# COCO, Pets, Lexica, Simpsons, WikiArt, Kream, Sketch (`cvl build-stream protocol cclip`) —
# scored by image-text retrieval on every dataset (the R matrix) and by zero-shot
# classification on held-out classification sets (its "zero-shot retention": compare.md's
# A_ZS column, one `--zeroshot-folder` per set).
#
# Runs (--methods):
#   zeroshot       the pretrained start on every task (the retention to keep)
#   seqft          full fine-tuning, task after task
#   lora           seqft with a LoRA per task merged after it (--tune lora)
#   cclip          C-CLIP: a LoRA per task integrated with α = 0.5 + CKC (cvl/methods/cclip.py)
#   lora-per-task  FoMo-in-Flux's separate LoRAs on the frozen start, deployed as their
#                  average (cvl/methods/lora_per_task.py)
#
# Full protocol: Flickr30K and COCO from --data (Karpathy JSONs + images), the other six as
# streams in --streams DIR (DIR/pets, ..., built as in datasets/cclip.md); the held-out
# classification sets as image folders in ZS_FOLDERS (environment, space-separated; e.g. from
# `recipes/cclip_table.py folder`); OpenAI ViT-B/16 through --weights:
#   ZS_FOLDERS="heldout/cifar10 heldout/cifar100" recipes/cclip.sh --data data \
#       --streams streams --weights ViT-B-16.pt --nproc 8 --out cclip-out
# Smoke (CPU, about a minute): a synthetic stream of 9 domains, the first 8 standing in for
# C-CLIP's datasets (the same task names and order), the 9th's test images a held-out
# classification folder; a tiny CLIP_0 trained on the stream's pretraining set stands in for
# CLIP; runs cclip and lora-per-task (each run's evaluation scores the start too: its
# metrics.json "fomo" rows begin with the initial weights):
#   recipes/cclip.sh --smoke --out cclip-smoke
# Hyperparameters: recipes/configs/cclip.yaml (smoke: configs/smoke.yaml, LoRA at 10x its
# rate, the rate a tiny model's adapters need to move).
#
# Common options (recipes/lib.sh):
source "$(dirname "$0")/lib.sh"
parse_args "$@"
OUT=${OUT:-cclip-out}
ALL="zeroshot seqft lora cclip lora-per-task"
TASKS="flickr30k coco pets lexica simpsons wikiart kream sketch"
if [ "$SMOKE" = 1 ]; then
  METHODS=${METHODS:-cclip lora-per-task}
  CFG="$RECIPES/configs/smoke.yaml"
  LORA=(--tune lora --lr 5e-3)
else
  METHODS=${METHODS:-$ALL}
  CFG="$RECIPES/configs/cclip.yaml"
  LORA=(--tune lora --tune-arg rank=16 --tune-arg alpha=32)
fi
check_choices method "$METHODS" "$ALL"
check_choices setting "$SETTINGS" "default"  # one setting
args_of() {
  case "$1" in
    zeroshot | seqft) echo "--method $1" ;;
    lora) echo "--method seqft ${LORA[*]}" ;;
    cclip) echo "--method cclip ${LORA[*]}" ;;
    lora-per-task) echo "--method lora_per_task ${LORA[*]}" ;;
    *) echo "error: unknown method '$1' for cclip.sh" >&2; exit 2 ;;
  esac
}
mkdir -p "$OUT"
EVAL_EXTRA=()
if [ "$SMOKE" = 1 ]; then
  step "synthetic stand-ins: 8 domains for C-CLIP's datasets, a 9th held out, a pretraining set"
  A="$OUT/sources/_all"
  build_stream "$A" synthetic --out "$A" --tasks 9 --per-task 16 --test-per-task 8 \
    --val-per-task 4 --query-per-task 4 --gallery-per-task 8 --pretrain 128 --seed "$SEED" \
    --quiet
  i=0 SPECS=()
  for t in $TASKS; do SPECS+=(--task "$t=$A:task=t$i"); i=$((i + 1)); done
  build_stream "$OUT/stream" compose --out "$OUT/stream" "${SPECS[@]}"
  if [ ! -f "$OUT/heldout/t8/classnames.txt" ]; then
    python3 "$RECIPES/cclip_table.py" stream-folder --stream "$A" --task t8 --out "$OUT/heldout/t8"
  fi
  ZS_FOLDERS="$OUT/heldout/t8"
  EVAL_EXTRA+=(--zs-templates synthetic)
  step "CLIP_0 on the pretraining set (stands in for the OpenAI weights)"
  train "$CFG" "$OUT/clip0" --stream "$A/pretrain" --method seqft
  INIT=(--init-run "$OUT/clip0")
else
  need_weights "C-CLIP starts from OpenAI ViT-B/16"
  step "build the protocol stream"
  build_stream "$OUT/stream" protocol cclip --data "$DATA" --streams "$STREAMS" \
    --seed "$SEED" --out "$OUT/stream"
  INIT=(--pretrained "$WEIGHTS")
fi
for F in ${ZS_FOLDERS:-}; do EVAL_EXTRA+=(--zeroshot-folder "$F"); done
train_and_compare "" "$CFG" "$OUT" "$OUT/stream" default "${INIT[@]}"
step "done: $OUT/compare/compare.md (retrieval per task; A_ZS = zero-shot retention)"
