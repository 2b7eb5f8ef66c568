#!/usr/bin/env bash
# Shared by the paper recipes (recipes/ctp_p9d.sh, incclip_cc12m.sh, modx.sh, dha_citm.sh,
# dkr.sh): options / environment, the launcher (one process, or `accelerate launch` for several
# processes and nodes), the global -> per-process batch, and the evaluate-and-compare step.
# Source it; do not run it.
#
# Options (each also an environment variable, options win):
#   --smoke              the same pipeline on synthetic stand-ins for the protocol's data
#                        (same tasks, eval sets and benchmarks), tiny models, CPU (SMOKE=1)
#   --out DIR            everything goes here (OUT) [recipe name + -out]
#   --data DIR           raw datasets (DATA): coco/, flickr30k/, ec/, iapr/, rsicd/, ...
#   --streams DIR        streams built beforehand from URL lists, named by source (STREAMS):
#                        cc3m/, wit/, goodnews/, cc12m/, p9d/ ...
#   --weights FILE       initial weights for --pretrained (WEIGHTS): an OpenAI/open_clip file
#   --model-config X     model config: packaged name, open_clip architecture or JSON (MODEL_CONFIG)
#   --nproc N            processes per node (NPROC) [1]; >1 launches `accelerate launch`
#   --nnodes N --node-rank R --main-addr HOST --main-port PORT
#                        several nodes (NNODES, NODE_RANK, MAIN_ADDR, MAIN_PORT): run the recipe
#                        on every node; rank 0 builds the streams and evaluates, the others
#                        wait for the streams and join each training launch
#   --methods "A B"      the runs to train in every setting (METHODS) [the paper's list;
#                        --smoke: all of it in the first setting, a subset in the others]
#   --settings "A B"     the protocol settings to run (SETTINGS) [all of the recipe's]
#   --seed N             (SEED) [0]
#   --max-batch-per-process N
#                        keep the YAML's global batch on fewer processes (MAX_BATCH_PER_PROCESS)
#                        [the YAML's recipe_max_batch_per_process, else none; 0: none]: when
#                        global / processes exceeds N, each step is K = ceil(that / N)
#                        micro-batches (`--grad-accum K --accum-mode $ACCUM_MODE`), refused
#                        in one line when K does not divide it. ACCUM_MODE [cached]: the loss
#                        of the whole global batch (docs/scaling.md); `plain` trains each
#                        micro-batch's own loss (fewer negatives: not the paper's objective)
# CVL (the cvl command; default: the repo's .venv/bin/cvl, else `cvl` on PATH) and ACCELERATE
# (default: accelerate next to CVL, else on PATH) choose the executables. Rerunning the same command skips
# what is finished: streams are kept, `cvl train` resumes (a finished run returns at once),
# `cvl eval` reads its cache.
set -euo pipefail

RECIPES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SMOKE=${SMOKE:-0}
OUT=${OUT:-}
DATA=${DATA:-data}
STREAMS=${STREAMS:-streams}
WEIGHTS=${WEIGHTS:-}
MODEL_CONFIG=${MODEL_CONFIG:-}
NPROC=${NPROC:-1}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MAIN_ADDR=${MAIN_ADDR:-127.0.0.1}
MAIN_PORT=${MAIN_PORT:-29500}
METHODS=${METHODS:-}
SETTINGS=${SETTINGS:-}
SEED=${SEED:-0}
MAX_BATCH_PER_PROCESS=${MAX_BATCH_PER_PROCESS:-}
ACCUM_MODE=${ACCUM_MODE:-cached}
# The cvl executable: $CVL, else the repo's .venv (make test / make demo create it), else PATH.
if [ -z "${CVL:-}" ]; then
  CVL=$RECIPES/../.venv/bin/cvl
  [ -x "$CVL" ] || CVL=$(command -v cvl || echo cvl)
fi
if [ -z "${ACCELERATE:-}" ]; then
  ACCELERATE=$(dirname "$CVL")/accelerate
  [ -x "$ACCELERATE" ] || ACCELERATE=$(command -v accelerate || echo accelerate)
fi

# --help: the recipe's header comment, then these common options.
usage() {
  local hdr='NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }'
  awk "$hdr" "$0"
  awk "$hdr" "${BASH_SOURCE[0]}" | sed -n '/^Options/,$p'
  exit "${1:-0}"
}

parse_args() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --smoke) SMOKE=1 ;;
      --out) OUT=$2; shift ;;
      --data) DATA=$2; shift ;;
      --streams) STREAMS=$2; shift ;;
      --weights) WEIGHTS=$2; shift ;;
      --model-config) MODEL_CONFIG=$2; shift ;;
      --nproc) NPROC=$2; shift ;;
      --nnodes) NNODES=$2; shift ;;
      --node-rank) NODE_RANK=$2; shift ;;
      --main-addr) MAIN_ADDR=$2; shift ;;
      --main-port) MAIN_PORT=$2; shift ;;
      --methods) METHODS=$2; shift ;;
      --settings) SETTINGS=$2; shift ;;
      --seed) SEED=$2; shift ;;
      --max-batch-per-process) MAX_BATCH_PER_PROCESS=$2; shift ;;
      -h | --help) usage 0 ;;
      *) echo "error: unknown option '$1' (--help lists them)" >&2; exit 2 ;;
    esac
    shift
  done
  WORLD=$((NPROC * NNODES))
  METHODS_GIVEN=$METHODS  # before the recipe's default (its whole list)
  t_start=$(date +%s)
}

step() { echo; echo "== [$(($(date +%s) - t_start)) s] $* =="; }

# The --weights file a protocol starts from: refused before any work when not given or missing.
# Usage: need_weights "what starts from them"
need_weights() {
  [ -n "$WEIGHTS" ] || { echo "error: $1: give --weights FILE" >&2; exit 2; }
  [ -f "$WEIGHTS" ] || { echo "error: --weights $WEIGHTS: file not found" >&2; exit 2; }
}

# Refuse unknown --methods / --settings before any work: check_choices WHAT "GIVEN" "KNOWN".
check_choices() {
  local x
  for x in $2; do
    [[ " $3 " == *" $x "* ]] || { echo "error: unknown $1 '$x' ($3)" >&2; exit 2; }
  done
}

# The value of a top-level `key: value` line of a recipe YAML (comments stripped).
cfg_get() { sed -n "s/^$1:[[:space:]]*\([^#]*\).*/\1/p" "$2" | tr -d '[:space:]'; }

# Per-process batch for the YAML's global batch_size (the papers give global batches).
per_process_batch() {
  local global
  global=$(cfg_get batch_size "$1")
  if [ $((global % WORLD)) -ne 0 ]; then
    echo "error: global batch $global is not divisible by $WORLD processes" >&2; exit 2
  fi
  echo $((global / WORLD))
}

# The batch options of one process for the YAML's global batch_size: `--batch-size B`, or,
# when B exceeds the per-process cap (MAX_BATCH_PER_PROCESS, else the YAML's
# recipe_max_batch_per_process; empty or 0: no cap), K = ceil(B / cap) micro-batches of B / K:
# `--batch-size B/K --grad-accum K --accum-mode $ACCUM_MODE` (the same global batch per step).
batch_args() {
  local per cap k
  per=$(per_process_batch "$1") || exit 2
  cap=${MAX_BATCH_PER_PROCESS:-$(cfg_get recipe_max_batch_per_process "$1")}
  if [ -z "$cap" ] || [ "$cap" -eq 0 ] || [ "$per" -le "$cap" ]; then
    echo "--batch-size $per"
    return
  fi
  k=$(((per + cap - 1) / cap))
  if [ $((per % k)) -ne 0 ]; then
    echo "error: per-process batch $per does not split into $k equal micro-batches of at most $cap (set MAX_BATCH_PER_PROCESS to a divisor of $per)" >&2
    exit 2
  fi
  echo "--batch-size $((per / k)) --grad-accum $k --accum-mode $ACCUM_MODE"
}

# Build a stream only on node 0 and only once; other nodes wait for it.
# Usage: build_stream DIR cvl-build-stream-args...
build_stream() {
  local dir=$1; shift
  if [ -f "$dir/stream.json" ]; then echo "reusing $dir"; return; fi
  if [ "$NODE_RANK" -ne 0 ]; then
    echo "waiting for node 0 to build $dir"
    until [ -f "$dir/stream.json" ]; do sleep 10; done
    return
  fi
  "$CVL" build-stream "$@"
}

# Train one run: CONFIG.yaml then the given options (explicit options win over the YAML).
# Usage: train CONFIG RUN cvl-train-args...
train() {
  local cfg=$1 run=$2 batch; shift 2
  batch=$(batch_args "$cfg") || exit 2
  # shellcheck disable=SC2206  # the batch options: words without spaces
  local extra=(--config "$cfg" $batch --seed "$SEED" --quiet)
  [ -n "$MODEL_CONFIG" ] && extra+=(--model-config "$MODEL_CONFIG")
  if [ "$WORLD" -gt 1 ]; then
    # --multi_gpu: without it, accelerate on a machine with no GPU ignores --num_processes and
    # starts ONE plain process; with it, N processes (gloo on CPU, NCCL on GPUs).
    "$ACCELERATE" launch --multi_gpu --num_processes "$WORLD" --num_machines "$NNODES" \
      --machine_rank "$NODE_RANK" --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" \
      --mixed_precision no --dynamo_backend no -m cvl train "${extra[@]}" "$@" --out "$run"
  else
    "$CVL" train "${extra[@]}" "$@" --out "$run"
  fi
}

# The methods one setting trains: METHODS, except in the smoke mode when --methods was not
# given and the setting FIRST (which trains every method) runs too: then the recipe's SUBSET.
# A later setting only changes the stream (order, split, parts, benchmarks) and a method's
# setting-specific arguments, which the subset still runs end to end; the training code of the
# other methods is the same on every stream and already ran on FIRST's.
# Usage: METHODS=$(smoke_subset FIRST "SUBSET")
smoke_subset() {
  if [ "$SMOKE" = 1 ] && [ -z "$METHODS_GIVEN" ] && [[ " $SETTINGS " == *" $1 "* ]]; then
    echo "$2"
  else
    echo "$METHODS"
  fi
}

# Train every method of METHODS into DIR/runs/METHOD (CONFIG, the stream, the recipe's
# `args_of METHOD SETTING`, then the EXTRA train options), then evaluate the runs and write the
# comparison (compare.md / .csv / .json and curves) into DIR/compare, on node 0 only. The smoke
# mode skips the linear probe (sklearn on every checkpoint); EVAL_EXTRA (an array) adds
# `cvl eval` options. Usage: train_and_compare LABEL CONFIG DIR STREAM SETTING [EXTRA...]
train_and_compare() {
  local label=$1 cfg=$2 dir=$3 stream=$4 setting=$5 m runs=() opts=(--quiet)
  shift 5
  for m in $METHODS; do
    step "${label}train $m"
    # shellcheck disable=SC2046
    train "$cfg" "$dir/runs/$m" --stream "$stream" $(args_of "$m" "$setting") "$@"
    runs+=("$dir/runs/$m")
  done
  step "${label}evaluate and compare"
  [ "$NODE_RANK" -ne 0 ] && return
  [ "$SMOKE" = 1 ] && opts+=(--no-probe)
  "$CVL" eval --compare "${runs[@]}" "${opts[@]}" ${EVAL_EXTRA[@]+"${EVAL_EXTRA[@]}"} \
    --out "$dir/compare"
}

# Smoke stand-ins for a protocol's sources: one synthetic stream with a task per source
# (neighbouring tasks share vocabulary), then a one-task stream per source, named after it,
# in DIR; `cvl build-stream protocol PRESET --streams DIR` then composes the paper's tasks,
# parts and benchmarks from them exactly as from the real sources. PRETRAIN > 0 also writes
# a pretraining set (DIR/_all/pretrain) for a CLIP_0 standing in for OpenAI's weights.
# Usage: smoke_sources DIR PAIRS_PER_SOURCE PRETRAIN SOURCE...
smoke_sources() {
  local dir=$1 per=$2 pre=$3 i=0 s; shift 3
  build_stream "$dir/_all" synthetic --out "$dir/_all" --tasks $# --per-task "$per" \
    --test-per-task 16 --val-per-task 10 --query-per-task 10 --gallery-per-task 20 \
    --pretrain "$pre" --seed "$SEED" --quiet
  for s in "$@"; do
    build_stream "$dir/$s" compose --task "$s=$dir/_all:task=t$i" --out "$dir/$s"
    i=$((i + 1))
  done
}

# The task names of a stream, in training order (one per line).
task_names() {
  python3 -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["task_order"]))' \
    "$1/stream.json"
}
