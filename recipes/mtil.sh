#!/usr/bin/env bash
# MTIL and X-TAIL (ZSCL, ICCV'23, Table 1; MoE-Adapters4CL, CVPR'24; RAIL, NeurIPS'24): 11
# classification datasets learned one after another by CLIP ViT-B/16 (OpenAI weights,
# --weights), each dataset a task; every checkpoint's zero-shot top-1 on all 11 test sets;
# Transfer / Avg. / Last per method, ZSCL Table 1's layout (OUT/SETTING/compare/compare.md).
#   order1  MTIL order I:  Aircraft -> Caltech101 -> CIFAR100 -> DTD -> EuroSAT -> Flowers ->
#           Food -> MNIST -> OxfordPet -> StanfordCars -> SUN397 (protocol mtil)
#   order2  MTIL order II: StanfordCars -> Food -> MNIST -> ... -> CIFAR100 (mtil-order2)
#   fs      MTIL few-shot, MoE-Adapters4CL's: 5 images per class, 500 steps per task (mtil-fs)
#   xtail   X-TAIL, RAIL's: 10 domains (no CIFAR100), 16 shots, 500 steps per task; scored over
#           all 1,100+ classes at every step (X-TAIL columns) as well as per dataset (x-tail)
# Methods (ZSCL Table 1's rows as cvl has them): zeroshot, seqft (Continual-FT), lwf (logits
# variant: ZSCL's LwF distils similarity logits), icarl (herding buffer, 10,000 images), wise
# (WiSE-FT, alpha 0.8 as ZSCL's script), zscl (reference set: STREAMS/zscl-ref), the merges
# (zs_merge ft_merge task_arith ties model_stock ema_merge ema_step) and seqft-lora (--tune lora); beyond
# Table 1, issue 38's: magmax dare dare_ties breadcrumbs slerp tall_masks opcm best_in_time,
# cclip and lora_per_task (--tune lora) and moe_adapters.
# Training as the ZSCL code (recipes/configs/mtil.yaml): --base-loss class-ce (cross-entropy
# over the current dataset's class texts, logit scale 100, label smoothing 0.2), batch 64,
# AdamW lr 1e-5 (5e-5 for Aircraft and MNIST), no weight decay, 100 warm-up steps + cosine,
# 1,000 steps per task (500 for fs / xtail).
#   recipes/mtil.sh --data data --streams streams --weights ViT-B-16.pt --nproc 8 --out mtil-out
# --data holds the datasets in torchvision's layouts or as NAME/{train,test}/CLASS/ folders
# (datasets/mtil.md); STREAMS/zscl-ref is ZSCL's reference set as a stream (e.g. CC3M pairs:
# `cvl build-stream cc3m ... --out streams/zscl-ref`; the code uses ImageNet images with CC
# captions). LwF-VR (ZSCL's row) is not in cvl.
# Smoke (CPU): 3 synthetic datasets of 4 shapes (`cvl build-stream synthetic-classes`) read
# back by `cvl build-stream classification` as image folders; a tiny CLIP_0 trained with the
# same objective on a pool of all their shapes drawn in mixed looks (standing in for OpenAI's
# weights; the pool is also ZSCL's reference set), 6 steps per task (ZSCL's weight-ensemble
# interval and the per-step EMA's decay scaled to them); settings order1 by default, methods zeroshot
# seqft icarl zscl ties seqft-lora (--methods adds lwf, wise and the other merges).
#   recipes/mtil.sh --smoke --out mtil-smoke
# Bigger stand-in (environment): SMOKE_DATASETS (3), SMOKE_TRAIN / SMOKE_TEST images per class
# (16 / 8), SMOKE_STEPS per task (6), SMOKE_LR, SMOKE_PRETRAIN images (192), SMOKE_CLIP0_STEPS
# (12), SMOKE_CLIP0_BATCH (per process), SMOKE_CLIP0_LR; recipes/mtil_benchmark.sh (the
# docs/mtil.md's table) sets them.
#
# Common options (recipes/lib.sh):
source "$(dirname "$0")/lib.sh"
parse_args "$@"
OUT=${OUT:-mtil-out}
MERGES="zs_merge ft_merge task_arith ties model_stock ema_merge ema_step"
# issue 38's merges and methods (not in ZSCL's Table 1; MoE-Adapters4CL reports MTIL)
NEWER="magmax dare dare_ties breadcrumbs slerp tall_masks opcm best_in_time cclip lora_per_task moe_adapters"
ALL="zeroshot seqft lwf icarl wise zscl $MERGES seqft-lora $NEWER"
SMOKE_METHODS="zeroshot seqft icarl zscl ties seqft-lora"
if [ "$SMOKE" = 1 ]; then
  METHODS=${METHODS:-$SMOKE_METHODS} SETTINGS=${SETTINGS:-order1}
else
  METHODS=${METHODS:-$ALL} SETTINGS=${SETTINGS:-"order1 order2 fs xtail"}
fi
check_choices method "$METHODS" "$ALL"
check_choices setting "$SETTINGS" "order1 order2 fs xtail"
BUF=10000   # ZSCL's iCaRL --memory_size
REF="$STREAMS/zscl-ref"
ZSCL_WE="" EMA_DECAY=""
if [ "$SMOKE" = 1 ]; then
  BUF=16 REF="$OUT/pretrain" S=${SMOKE_STEPS:-6}
  # per-step constants scaled to the smoke's S steps per task as to the code's 1,000: ZSCL's
  # weight ensemble every S/10 steps (the code: every 100 of 1,000), ema_step's decay d with
  # d^S = 0.999^1000 (the share of the task it keeps)
  ZSCL_WE="--method-arg we_every=$(((S + 9) / 10))"
  EMA_DECAY="--method-arg decay=$(python3 -c "print(round(0.999 ** (1000 / $S), 4))")"
fi
args_of() {  # $1 method, $2 setting
  case "$1" in
    zeroshot | seqft) echo "--method $1" ;;
    lwf) echo "--method lwf --method-arg variant=logits" ;;
    icarl) echo "--method icarl --method-arg variant=logits --buffer mof --buffer-size $BUF" ;;
    wise) echo "--method wise --method-arg alpha=0.8" ;;
    zscl) echo "--method zscl --method-arg ref_stream=$REF $ZSCL_WE" ;;
    ema_step) echo "--method ema_step $EMA_DECAY" ;;  # the per-step EMA (decay per step)
    zs_merge | ft_merge | ema_merge | task_arith | ties | model_stock) echo "--method $1" ;;
    seqft-lora) echo "--method seqft --tune lora" ;;
    magmax | dare | dare_ties | breadcrumbs | slerp | tall_masks | opcm | best_in_time) echo "--method $1" ;;
    moe_adapters) echo "--method moe_adapters $(moe_lr "$2")" ;;
    cclip | lora_per_task) echo "--method $1 --tune lora" ;;
    *) echo "error: unknown method '$1' for mtil.sh" >&2; exit 2 ;;
  esac
}
# MoE-Adapters4CL's own peak rates per dataset (JiazuoYu/MoE-Adapters4CL, mtil/scripts/train/
# train_full_shot_router11_experts22_1000iters.sh and train_few_shot_..._1000iters.sh, the `lr`
# arrays; AdamW, no decay, 100 warm-up steps + cosine as ZSCL's); ZSCL's 1e-5 is for full
# fine-tuning. X-TAIL (no script of theirs; few-shot, no CIFAR100) takes the few-shot rates.
# The smoke's synthetic tasks keep the smoke's rate.
moe_lr() {  # $1 setting
  [ "$SMOKE" = 1 ] && return
  case "$1" in
    order1 | order2) echo "--lr 1e-3 --task-lr aircraft=5e-3 --task-lr cifar100=5e-3 --task-lr eurosat=1e-4 --task-lr mnist=1e-4" ;;
    fs | xtail)
      local t="--lr 1e-3 --task-lr aircraft=8e-3 --task-lr caltech101=5e-4 --task-lr dtd=5e-3 --task-lr food=1e-2 --task-lr mnist=1e-4 --task-lr oxford_pet=1e-2 --task-lr stanford_cars=1e-2 --task-lr sun397=1e-2"
      [ "$1" = fs ] && t="$t --task-lr cifar100=2e-4"
      echo "$t" ;;
  esac
}
preset_of() {  # the protocol preset of a setting
  case "$1" in order1) echo mtil ;; order2) echo mtil-order2 ;; fs) echo mtil-fs ;; xtail) echo x-tail ;; esac
}
steps_of() { case "$1" in fs | xtail) echo 500 ;; *) echo 1000 ;; esac; }
if [ "$SMOKE" = 1 ]; then
  CFG="$RECIPES/configs/mtil-smoke.yaml"
  ND=${SMOKE_DATASETS:-3}
  NAMES=$(seq -s, -f 'synth%g' 0 $((ND - 1)))
  step "synthetic class folders: $ND datasets + a pretraining pool over all their classes"
  if [ ! -d "$OUT/data" ]; then
    "$CVL" build-stream synthetic-classes --out "$OUT/data" --datasets "$ND" \
      --train-per-class "${SMOKE_TRAIN:-16}" --test-per-class "${SMOKE_TEST:-8}" \
      --pretrain "${SMOKE_PRETRAIN:-192}" --seed "$SEED" --quiet
  fi
  build_stream "$REF" classification --data "$OUT/data" --datasets pretrain \
    --templates synthetic --seed "$SEED" --out "$REF" --quiet
  step "CLIP_0 on the pretraining pool (stands in for the OpenAI weights)"
  C0=(--steps-per-task "${SMOKE_CLIP0_STEPS:-12}")
  [ -n "${SMOKE_CLIP0_BATCH:-}" ] && C0+=(--batch-size "$SMOKE_CLIP0_BATCH")
  [ -n "${SMOKE_CLIP0_LR:-}" ] && C0+=(--lr "$SMOKE_CLIP0_LR")
  train "$CFG" "$OUT/clip0" --stream "$REF" --method seqft "${C0[@]}"
  INIT=(--init-run "$OUT/clip0")
else
  CFG="$RECIPES/configs/mtil.yaml"
  need_weights "MTIL starts from OpenAI CLIP ViT-B/16"
  INIT=(--pretrained "$WEIGHTS")
  if [[ " $METHODS " == *" zscl "* && ! -f "$REF/stream.json" ]]; then
    echo "error: zscl needs its reference set as a stream: $REF (see --help)" >&2; exit 2
  fi
fi
for S in $SETTINGS; do
  D="$OUT/$S" STREAM="$OUT/$S/stream"
  mkdir -p "$D"
  step "$S: build the stream"
  if [ "$SMOKE" = 1 ]; then
    case "$S" in
      order1) SRC=(--datasets "$NAMES") ;;
      order2) SRC=(--datasets "$(echo "$NAMES" | tr ',' '\n' | tac | paste -sd,)") ;;
      fs) SRC=(--datasets "$NAMES" --shots 5) ;;
      xtail) SRC=(--datasets "$NAMES" --shots 8 --union-template "a {}") ;;
    esac
    build_stream "$STREAM" classification --data "$OUT/data" "${SRC[@]}" --templates synthetic \
      --seed "$SEED" --out "$STREAM" --quiet
    EXTRA=(--steps-per-task "${SMOKE_STEPS:-6}")
    [ -n "${SMOKE_LR:-}" ] && EXTRA+=(--lr "$SMOKE_LR")
  else
    build_stream "$STREAM" protocol "$(preset_of "$S")" --data "$DATA" --seed "$SEED" --out "$STREAM"
    EXTRA=(--steps-per-task "$(steps_of "$S")")
  fi
  train_and_compare "$S: " "$CFG" "$D" "$STREAM" "$S" "${INIT[@]}" ${EXTRA[@]+"${EXTRA[@]}"}
done
step "done: $OUT/*/compare/compare.md"
