#!/usr/bin/env bash
# A FoMo-in-Flux-style study (Roth et al., NeurIPS 2024 D&B, "A Practitioner's Guide to
# Continual Multimodal Pretraining"; code: pseudope/fomo_in_flux): continual pretraining of a
# pretrained CLIP on a stream of adaptation datasets, each global batch mixed from the
# pretraining data, the current task and a buffer of the earlier tasks (FoMo's default
# 0.33 / 0.34 / 0.33), the same compute per task (FoMo: 727,040 samples per task; here
# `--budget samples=N/task`), and the learning-rate meta-schedules its paper compares; scored
# by knowledge accumulation (A_KA, the adaptation tasks), zero-shot retention (A_ZS, held-out
# sets never trained on) and their geometric mean (compare.md: A_KA, A_ZS, GM (FoMo)).
#
# Runs (--methods; each is seqft unless named, FoMo's "finetune"):
#   ft            no mixture, no buffer: FoMo's per-task cosine (offline_merge_*_noreplay)
#   mix           the mixture + per-task cosine (cosine-fomo: FoMo's cosine_with_linear_warmup)
#   mix-ar        + the autoregressive cosine meta-schedule (cosine-ar)
#   mix-dyn       + the dynamic cosine meta-schedule (cosine-dyn)
#   mix-rsqrt     + rsqrt with cool-down per task (infinite schedule)
#   mix-rsqrt-ar  + the autoregressive rsqrt meta-schedule (rsqrt-ar)
#   mix-stream    + one warm-up + cosine over the whole stream (stream-cosine, cvl's)
#   mix-ema       ema_merge (FoMo's EMA merge) with the mixture and cosine-fomo
#
# Full study: the adaptation stream in STREAMS/fomo (one task per FoMo task, held-out
# datasets as its benchmarks) and the pretraining pool in STREAMS/fomo-pretrain, built as in
# datasets/fomo.md; OpenCLIP weights through --weights (FoMo: ViT-B/16 or B/32, LAION-2B):
#   recipes/fomo.sh --streams streams --weights ViT-B-32-laion2b.bin --nproc 8 --out fomo-out
# Smoke (CPU, ~1-2 min): a synthetic stream (3 adaptation tasks, 2 held-out tasks as
# benchmarks, a pretraining set); a tiny CLIP_0 trained on the pretraining set stands in for
# OpenCLIP and the same set is the mixture's pretraining source; runs ft, mix-ar, mix-rsqrt-ar:
#   recipes/fomo.sh --smoke --out fomo-smoke
# Hyperparameters: recipes/configs/fomo.yaml (smoke: configs/smoke.yaml). MIXTURE (environment)
# changes the shares [task=0.34,buffer=0.33,pretrain=0.33], BUFFER the buffer's size (FoMo
# replays every earlier task's data: here a reservoir of BUFFER pairs [50,000; smoke 32]).
#
# Common options (recipes/lib.sh):
source "$(dirname "$0")/lib.sh"
parse_args "$@"
OUT=${OUT:-fomo-out}
ALL="ft mix mix-ar mix-dyn mix-rsqrt mix-rsqrt-ar mix-stream mix-ema"
if [ "$SMOKE" = 1 ]; then
  METHODS=${METHODS:-ft mix-ar mix-rsqrt-ar}
  CFG="$RECIPES/configs/smoke.yaml" BUFFER=${BUFFER:-32}
  # the same 12 steps per task for every run (FoMo: the same samples per task), two of them
  # warm-up (rsqrt needs one)
  SCHED=(--warmup 2 --epochs 2 --budget samples=96/task --min-lr 5e-7)
else
  METHODS=${METHODS:-$ALL}
  CFG="$RECIPES/configs/fomo.yaml" BUFFER=${BUFFER:-50000}
  SCHED=()
fi
MIXTURE=${MIXTURE:-task=0.34,buffer=0.33,pretrain=0.33}
check_choices method "$METHODS" "$ALL"
check_choices setting "$SETTINGS" "default"  # one setting
mkdir -p "$OUT"
if [ "$SMOKE" = 1 ]; then
  step "synthetic stand-ins: 5 domains (3 adapted, 2 held out) and a pretraining set"
  build_stream "$OUT/sources/_all" synthetic --out "$OUT/sources/_all" --tasks 5 \
    --per-task 48 --test-per-task 16 --val-per-task 4 --query-per-task 4 \
    --gallery-per-task 8 --pretrain 128 --seed "$SEED" --quiet
  A="$OUT/sources/_all"
  build_stream "$OUT/stream" compose --out "$OUT/stream" --task "t0=$A:task=t0" \
    --task "t1=$A:task=t1" --task "t2=$A:task=t2" --eval "held-t3=$A:task=t3" \
    --eval "held-t4=$A:task=t4"
  STREAM="$OUT/stream" PRE="$A/pretrain"
  step "CLIP_0 on the pretraining set (stands in for the OpenCLIP weights)"
  train "$CFG" "$OUT/clip0" --stream "$PRE" --method seqft
  INIT=(--init-run "$OUT/clip0")
else
  STREAM="$STREAMS/fomo" PRE="$STREAMS/fomo-pretrain"
  for d in "$STREAM" "$PRE"; do
    [ -f "$d/stream.json" ] || { echo "error: $d: no stream (datasets/fomo.md)" >&2; exit 2; }
  done
  need_weights "FoMo-in-Flux starts from a pretrained OpenCLIP model"
  INIT=(--pretrained "$WEIGHTS")
fi
MIX=(--mixture "$MIXTURE" --pretrain-data "$PRE" --buffer reservoir --buffer-size "$BUFFER")
args_of() {
  case "$1" in
    ft) echo "--method seqft --lr-schedule cosine-fomo" ;;
    mix) echo "--method seqft --lr-schedule cosine-fomo ${MIX[*]}" ;;
    mix-ar) echo "--method seqft --lr-schedule cosine-ar ${MIX[*]}" ;;
    mix-dyn) echo "--method seqft --lr-schedule cosine-dyn ${MIX[*]}" ;;
    mix-rsqrt) echo "--method seqft --lr-schedule rsqrt ${MIX[*]}" ;;
    mix-rsqrt-ar) echo "--method seqft --lr-schedule rsqrt-ar ${MIX[*]}" ;;
    mix-stream) echo "--method seqft --lr-schedule stream-cosine ${MIX[*]}" ;;
    mix-ema) echo "--method ema_merge --lr-schedule cosine-fomo ${MIX[*]}" ;;
    *) echo "error: unknown method '$1' for fomo.sh" >&2; exit 2 ;;
  esac
}
train_and_compare "" "$CFG" "$OUT" "$STREAM" default "${INIT[@]}" ${SCHED[@]+"${SCHED[@]}"}
step "done: $OUT/compare/compare.md (A_KA, A_ZS, GM (FoMo) per run)"
