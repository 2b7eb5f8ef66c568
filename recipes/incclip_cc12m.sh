#!/usr/bin/env bash
# IncCLIP's CC12M protocols (IncCLIP paper §5, Tables 1-3), RN50 CLIP from scratch:
#   class4 / class8  class split: every image's BEiT (ImageNet-1k) top-1 pseudo-label, the
#                    1,000 classes cut into 4 (or 8) steps (`cvl pseudo-label` +
#                    `cvl build-stream class-split`)
#   instance         2M random pairs in 4 equal chunks
# Runs ER, UCIR (lucir), GeoDL, Co2L and IncCLIP, all with the paper's 10 % memory; one
# comparison table per setting (OUT/SETTING/compare/compare.md, with BWT-IncCLIP, zero-shot
# classification of the class split's classes and zero-shot retrieval on the COCO(5K) and
# Flickr30K(1K) benchmarks, attached to every setting's stream).
#   recipes/incclip_cc12m.sh --data data --nproc 8 --out incclip-out
# DATA/cc12m/cc12m.tsv is the CC12M list; BEIT (default microsoft/beit-base-patch16-224: a hub
# id or a local folder) labels the class-split pool; ZS_FOLDERS="DIR ..." adds labelled
# image folders (the paper's 8 zero-shot datasets) to the evaluation. The benchmarks come from
# STREAMS/coco and STREAMS/flickr30k when built, else from DATA/coco and DATA/flickr30k
# (Karpathy JSON + images, test sets only; datasets/coco.md, datasets/flickr30k.md).
# Smoke (CPU): a synthetic pool of 28 shapes (168 pairs) split by shape into 4 and 8 steps
# (the category stands in for the BEiT label), a 4-task synthetic instance split and synthetic
# stand-ins for the COCO / Flickr30K benchmarks; tiny RN CLIP, LAMB, 1 epoch; every method in
# class4, ER and IncCLIP in class8 and instance (their streams, evaluations and tables; the
# other methods train the same way on any split).
#   recipes/incclip_cc12m.sh --smoke --out incclip-smoke
# Hyperparameters: recipes/configs/incclip_cc12m.yaml (LAMB lr 3e-3, wd 3e-3, as the paper).
#
# Common options (recipes/lib.sh):
source "$(dirname "$0")/lib.sh"
parse_args "$@"
OUT=${OUT:-incclip-out}
ALL="er lucir geodl co2l incclip"
METHODS=${METHODS:-$ALL} SETTINGS=${SETTINGS:-"class4 class8 instance"}
check_choices method "$METHODS" "$ALL"
check_choices setting "$SETTINGS" "class4 class8 instance"
BEIT=${BEIT:-microsoft/beit-base-patch16-224}
if [ "$SMOKE" = 1 ]; then
  CFG="$RECIPES/configs/smoke.yaml" MEM=16 OPT=(--optimizer lamb)  # LAMB as the full config
else
  CFG="$RECIPES/configs/incclip_cc12m.yaml" MEM=200000 OPT=()  # 10 % of CC2M
fi
args_of() {
  case "$1" in
    er) echo "--method seqft --buffer reservoir --buffer-size $MEM" ;;
    lucir) echo "--method lucir --buffer mof --buffer-size $MEM" ;;  # UCIR: herding memory
    geodl | co2l | incclip) echo "--method $1 --buffer reservoir --buffer-size $MEM" ;;
    *) echo "error: unknown method '$1' for incclip_cc12m.sh" >&2; exit 2 ;;
  esac
}
EVAL_EXTRA=()
for F in ${ZS_FOLDERS:-}; do EVAL_EXTRA+=(--zeroshot-folder "$F"); done
# The zero-shot retrieval benchmarks (test sets of COCO and Flickr30K).
BENCH="$OUT/benchmarks"
step "the COCO(5K) / Flickr30K(1K) benchmarks"
if [ "$SMOKE" = 1 ]; then
  smoke_sources "$BENCH" 16 0 coco flickr30k
else
  for B in coco flickr30k; do
    if [ -f "$STREAMS/$B/stream.json" ]; then
      mkdir -p "$BENCH" && ln -sfn "$(cd "$STREAMS/$B" && pwd)" "$BENCH/$B"
    else
      JSON="$DATA/$B/dataset_$B.json" IMAGES="$DATA/$B"
      [ "$B" = flickr30k ] && IMAGES="$DATA/$B/flickr30k-images"
      build_stream "$BENCH/$B" "$B" --json "$JSON" --images "$IMAGES" --max-train 1 \
        --max-val 1 --seed "$SEED" --out "$BENCH/$B"
    fi
  done
fi
# Usage: with_benchmarks SRC OUT: the stream SRC, its tasks as they are, plus the benchmarks.
with_benchmarks() {
  local t tasks=()
  for t in $(task_names "$1"); do tasks+=(--task "$t=$1:task=$t"); done
  build_stream "$2" compose "${tasks[@]}" --eval "coco-5k=$BENCH/coco" \
    --eval "f30k-1k=$BENCH/flickr30k" --out "$2"
}
POOL="$OUT/pool"
for S in $SETTINGS; do
  D="$OUT/$S" STREAM="$OUT/$S/stream"
  mkdir -p "$D"
  case "$S" in
    class4 | class8)
      step "$S: the labelled pool"
      if [ "$SMOKE" = 1 ]; then
        build_stream "$POOL" synthetic --out "$POOL" --tasks 7 --shapes-per-task 4 --overlap 0 \
          --per-task 24 --test-per-task 16 --val-per-task 4 --query-per-task 4 \
          --gallery-per-task 8 --seed "$SEED" --quiet
        LABELS=category
      else
        build_stream "$POOL" cc12m --tsv "$DATA/cc12m/cc12m.tsv" --chunks 1 --sample 2000000 \
          --test 5000 --seed "$SEED" --out "$POOL"
        LABELS=$(basename "$BEIT")
        # BEiT labels on node 0 (NPROC processes); other nodes only need the split streams
        if [ ! -f "$POOL/labels/$LABELS/labels.json" ] && [ "$NODE_RANK" -eq 0 ]; then
          if [ "$NPROC" -gt 1 ]; then
            "$ACCELERATE" launch --multi_gpu --num_processes "$NPROC" --mixed_precision no \
              --dynamo_backend no -m cvl pseudo-label --stream "$POOL" --model "$BEIT" --name "$LABELS"
          else
            "$CVL" pseudo-label --stream "$POOL" --model "$BEIT" --name "$LABELS"
          fi
        fi
      fi
      step "$S: class split into ${S#class} steps"
      build_stream "$D/split" class-split --from "$POOL" --labels "$LABELS" --steps "${S#class}" \
        --seed "$SEED" --out "$D/split" ;;
    instance)
      step "$S: instance split (4 random chunks)"
      if [ "$SMOKE" = 1 ]; then
        build_stream "$D/split" synthetic --out "$D/split" --tasks 4 --per-task 32 \
          --test-per-task 24 --val-per-task 8 --query-per-task 8 --gallery-per-task 16 \
          --seed "$SEED" --quiet
      else
        build_stream "$D/split" cc12m --tsv "$DATA/cc12m/cc12m.tsv" --chunks 4 --sample 2000000 \
          --test 5000 --seed "$SEED" --out "$D/split"
      fi ;;
  esac
  step "$S: attach the COCO / Flickr30K benchmarks"
  with_benchmarks "$D/split" "$STREAM"
  M=$METHODS
  [ "$S" != class4 ] && M=$(smoke_subset class4 "er incclip")
  METHODS=$M train_and_compare "$S: " "$CFG" "$D" "$STREAM" "$S" ${OPT[@]+"${OPT[@]}"}
done
step "done: $OUT/*/compare/compare.md"
