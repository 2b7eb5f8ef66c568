"""`cvl train`: train a method on a stream, one task after another (resumable)."""

from __future__ import annotations

from typing import Any

import click

from cvl.device import deterministic_option, device_option
from cvl.train.config import LIMITS
from cvl.train.schedules import SCHEDULES

# `--buffer` choices (= cvl.methods.buffers.buffer_names(), checked by a test; listed here so
# that `cvl train --help` does not import torch)
BUFFER_CHOICES = [
    "reservoir",
    "ring",
    "kmeans",
    "mof",
    "cumulative-all",
    "cumulative-equal",
    "cumulative-exp",
]

# CLI option name -> TrainConfig field; only options given explicitly override the YAML.
_OPTS = [
    "stream",
    "out",
    "method",
    "model",
    "model_config",
    "pretrained",
    "init_run",
    "epochs",
    "batch_size",
    "lr",
    "min_lr",
    "optimizer",
    "fused_adamw",
    "weight_decay",
    "warmup",
    "warmup_later",
    "lr_schedule",
    "cooldown",
    "grad_clip",
    "grad_accum",
    "accum_mode",
    "precision",
    "seed",
    "augment",
    "buffer",
    "buffer_size",
    "tune",
    "workers",
    "shuffle_block",
    "io_concurrency",
    "shard_cache",
    "shard_cache_gb",
    "checkpoint_every",
    "log_every",
    "log_with",
    "max_steps_per_task",
    "steps_per_task",
    "base_loss",
    "select",
    "skip_nonfinite",
    "grad_checkpointing",
    "compile",
    "fsdp",
    "device",
    "deterministic",
    "sync_bn",
    "budget",
    "mixture",
    "pretrain_data",
]


@click.command("train")
@click.option("--stream", type=click.Path(), help="Stream folder (from `cvl build-stream`).")
@click.option(
    "--out", type=click.Path(file_okay=False), help="Run folder; rerun the same command to resume."
)
@click.option(
    "--method", default="seqft", show_default=True, help="Method name (see `cvl methods`)."
)
@click.option(
    "--method-arg",
    "method_arg",
    multiple=True,
    metavar="NAME=VALUE",
    help="Override a method default (repeatable).",
)
@click.option(
    "--model",
    default="clip",
    show_default=True,
    type=click.Choice(["clip", "fusion"]),
    help="Dual encoder (open_clip) or ALBEF-style fusion model.",
)
@click.option(
    "--model-config",
    default="tiny",
    show_default=True,
    help="Packaged config (tiny, tiny-vit), open_clip architecture (RN50, ViT-B-32), or JSON file.",
)
@click.option(
    "--pretrained",
    default=None,
    type=click.Path(),
    help="Local weights file to start from: an open_clip/OpenAI checkpoint or a cvl "
    "model.safetensors (no downloads).",
)
@click.option(
    "--init-run",
    default=None,
    type=click.Path(),
    help="Start from a cvl run: its last finished task's weights (e.g. CLIP_0 trained on "
    "`build-stream synthetic --pretrain`), or a task folder RUN/tasks/NN-name. Same model "
    "config as that run.",
)
@click.option(
    "--epochs", type=LIMITS["epochs"], default=2, show_default=True, help="Epochs per task."
)
@click.option(
    "--batch-size",
    type=LIMITS["batch_size"],
    default=64,
    show_default=True,
    help="Per-process batch; global = this × processes.",
)
@click.option(
    "--lr",
    type=LIMITS["lr"],
    default=5e-4,
    show_default=True,
    help="Peak learning rate (the optimizer is re-created per task).",
)
@click.option(
    "--min-lr", type=LIMITS["min_lr"], default=0.0, show_default=True, help="Cosine schedule floor."
)
@click.option(
    "--optimizer",
    default="adamw",
    show_default=True,
    type=click.Choice(["adamw", "lamb"]),
    help="AdamW, or LAMB (timm's; layer-wise trust ratio, IncCLIP's optimizer).",
)
@click.option("--weight-decay", type=LIMITS["weight_decay"], default=0.1, show_default=True)
@click.option(
    "--warmup",
    type=LIMITS["warmup"],
    default=0.0,
    show_default=True,
    help="Warm-up: fraction of the task's steps (<1) or steps (>=1).",
)
@click.option(
    "--warmup-later",
    type=LIMITS["warmup"],
    default=None,
    help="Warm-up of every task that starts from trained weights: every task after the first, except those of a method that restarts from the initial weights (`joint restart=true`) (same units as --warmup) [--warmup]: "
    "TiC-CLIP's warm start, e.g. --warmup 10000 --warmup-later 2000.",
)
@click.option(
    "--lr-schedule",
    default="cosine",
    show_default=True,
    type=click.Choice(list(SCHEDULES)),
    help="cosine: warm-up + cosine restarted every task; stream-cosine: one warm-up + cosine "
    "over the whole stream (planned from the tasks' steps or budget shares); FoMo-in-Flux's "
    "per-task cosine-fomo and rsqrt (√(W/n) + linear cool-down) and its meta-schedules, where "
    "each task's peak follows the stream: cosine-ar, cosine-dyn, rsqrt-ar, rsqrt-cont "
    "(docs/schedules.md: Learning-rate schedules).",
)
@click.option(
    "--cooldown",
    type=LIMITS["cooldown"],
    default=0.1,
    show_default=True,
    help="rsqrt schedules: linear cool-down to 0 at each task's end, fraction of its steps (<1) "
    "or steps (>=1; more than a task has is refused).",
)
@click.option(
    "--grad-clip",
    type=LIMITS["grad_clip"],
    default=0.0,
    show_default=True,
    help="Max gradient norm (0 = off).",
)
@click.option(
    "--grad-accum",
    type=LIMITS["grad_accum"],
    default=1,
    show_default=True,
    help="Micro-batches per optimizer step (what they train: --accum-mode).",
)
@click.option(
    "--accum-mode",
    default="plain",
    show_default=True,
    type=click.Choice(["plain", "cached"]),
    help="What --grad-accum K trains. cached: the loss of ONE batch of K x batch-size x "
    "processes (every contrastive matrix over all of its pairs, distillation, queues, replay "
    "as one big batch) with the memory of one micro-batch: each micro-batch runs forward "
    "without a graph, the loss runs once on all their features, then each micro-batch runs "
    "forward again and back-propagates its features' gradients (GradCache; ~one more forward "
    "per micro-batch; the same randomness replayed; BatchNorm statistics per micro-batch as "
    "in plain); methods it cannot serve are refused (`cvl methods`). plain: each micro-batch "
    "its own loss (K times fewer negatives). plain is the default because it is the objective "
    "every run trained before this option (a run.json without the key resumes as plain), "
    "costs no extra forward and runs every method and model; use cached to reproduce a "
    "paper's global batch on fewer GPUs (docs/scaling.md).",
)
@click.option(
    "--precision",
    default="no",
    show_default=True,
    type=click.Choice(["no", "bf16", "fp16"]),
    help="Mixed precision: no = float32; bf16 = bfloat16 autocast (CPU and GPU); fp16 = "
    "float16 autocast with loss scaling (GPU only; gradients are unscaled before a method's "
    "after_backward).",
)
@click.option("--seed", type=LIMITS["seed"], default=0, show_default=True)
@click.option(
    "--augment",
    default="openclip",
    show_default=True,
    type=click.Choice(["openclip", "ctp", "none"]),
)
@click.option(
    "--buffer",
    default=None,
    type=click.Choice(BUFFER_CHOICES),
    help="Replay buffer strategy (any method): reservoir (ER), ring (DHA), kmeans, mof "
    "(herding), or TiC-CLIP's cumulative-all (every past pair), cumulative-equal (the budget "
    "split equally among past tasks), cumulative-exp (halved per task of age).",
)
@click.option(
    "--buffer-size",
    type=LIMITS["buffer_size"],
    default=0,
    help="Replay buffer capacity (pairs); not with cumulative-all.",
)
@click.option(
    "--tune",
    default="full",
    show_default=True,
    type=click.Choice(
        ["full", "lora", "dora", "vera", "bitfit", "lnfit", "locked-image", "locked-text"]
    ),
    help="Which parameters train (any method): all; LoRA / DoRA / VeRA adapters on the weights "
    "(merged into them at each task end, so checkpoints stay plain full weights); biases only "
    "(BitFit); normalisation layers only (LNFit); everything but the image / text tower (LiT).",
)
@click.option(
    "--tune-arg",
    "tune_arg",
    multiple=True,
    metavar="NAME=VALUE",
    help="LoRA/DoRA: rank (8), alpha (8), targets (linear | attn | mlp | conv | name patterns, "
    "joined with +); VeRA: rank (256), targets, d_initial (0.1), projection_seed (0: its "
    "shared frozen A and B); any mode: bn_stats=frozen|train (running statistics of frozen "
    "BatchNorm layers). Repeatable.",
)
@click.option(
    "--workers",
    type=LIMITS["workers"],
    default=-1,
    show_default=True,
    help="Loader worker processes per training process (decode + augment): -1 = auto: the "
    "usable CPUs / the node's training processes - 1 (at least 1, no upper limit); 0 = in the "
    "training process.",
)
@click.option(
    "--shuffle-block",
    type=LIMITS["shuffle_block"],
    default=1,
    show_default=True,
    help="Epoch order: 1 = every sample shuffled over the task; K > 1 = shard-local: blocks of "
    "K neighbouring samples (of one shard) are shuffled and read together, and the samples "
    "inside each block, for storage where random reads are slow (object stores, network file "
    "systems: a stream at a URL is then fetched by runs of K samples, ~1/K requests a sample). "
    "Blocks are re-cut and re-keyed every epoch, but a global batch of B draws from only "
    "~max(1, B/K) runs of neighbouring samples (1-2 when K >= B): its negatives come from few "
    "shards; the log says how many. The same batches on any number of processes; recorded in "
    "run.json.",
)
@click.option(
    "--io-concurrency",
    type=LIMITS["io_concurrency"],
    default=0,
    show_default=True,
    help="Streams at URLs (http(s)://, s3://, gs://): byte ranges in flight together per loader "
    "process (each worker's batch is read at once, so latency is paid once a batch); 0 = 64. "
    "Raise it for high-latency stores or large per-process batches; lower it for a server that "
    "limits connections. Changes no result.",
)
@click.option(
    "--shard-cache",
    type=click.Path(file_okay=False),
    default=None,
    help="Streams at URLs: a local folder where whole shards are fetched once per node (one "
    "streamed request each) and read from then on, the shards of coming batches fetched ahead; "
    "for a server that ignores byte ranges, or to read a task many times. Pays off when it can "
    "hold the task's shards, or with --shuffle-block. Changes no result.",
)
@click.option(
    "--shard-cache-gb",
    type=LIMITS["shard_cache_gb"],
    default=0.0,
    show_default=True,
    help="The --shard-cache folder's size bound in GB (0 = 64); the shards used longest ago "
    "are removed past it.",
)
@click.option(
    "--checkpoint-every",
    type=LIMITS["checkpoint_every"],
    default=50,
    show_default=True,
    help="Optimizer steps between mid-task checkpoints.",
)
@click.option(
    "--log-every",
    type=LIMITS["log_every"],
    default=10,
    show_default=True,
    help="Optimizer steps per train_log.jsonl line (+ one at each checkpoint and task end); "
    "a line averages the steps since the previous one. Losses are reduced across processes "
    "only then.",
)
@click.option(
    "--log-with",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "tensorboard", "wandb", "none"]),
)
@click.option(
    "--max-steps-per-task",
    type=LIMITS["max_steps_per_task"],
    default=0,
    help="Stop each task after N steps (smoke tests).",
)
@click.option(
    "--steps-per-task",
    type=LIMITS["steps_per_task"],
    default=0,
    help="Train every task exactly N optimizer steps, going through its data as many times as "
    "that takes (the ZSCL code's --iterations; the warm-up + cosine schedule spans the N "
    "steps); 0 = --epochs.",
)
@click.option(
    "--task-lr",
    "task_lr",
    multiple=True,
    metavar="TASK=LR",
    help="Peak learning rate of one task (repeatable; others use --lr), e.g. aircraft=5e-5.",
)
@click.option(
    "--base-loss",
    default="itc",
    show_default=True,
    type=click.Choice(["itc", "class-ce"]),
    help="The base loss of every method: itc = InfoNCE over the batch's image-caption pairs; "
    "class-ce = cross-entropy of each image over the text embeddings of all the task's classes "
    "(classification streams; the ZSCL code's MTIL objective: the model's logit scale, not "
    "trained (100 for OpenAI's CLIP), label smoothing 0.2). Methods with their own "
    "contrastive loss (ctp, der, co2l, incclip) refuse class-ce.",
)
@click.option(
    "--base-loss-arg",
    "base_loss_arg",
    multiple=True,
    metavar="NAME=VALUE",
    help="class-ce: scale (0 = the model's logit scale; > 0 fixes it), smoothing (0.2), "
    "template (0: the dataset's first). Repeatable.",
)
@click.option(
    "--select",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "last", "best-val"]),
    help="Weights that end each task: the last ones, or the best epoch on the task's 'val' "
    "pairs (Rm; DHA's protocol). auto = best-val for methods that ask for it (dha) when the "
    "stream has val pairs, else last.",
)
@click.option(
    "--skip-nonfinite",
    type=LIMITS["skip_nonfinite"],
    default=0,
    show_default=True,
    help="Optimizer steps with a NaN/Inf loss to skip (no update, counted in the log as "
    "nonfinite_skipped) before the run stops; 0 = stop at the first one. A task stops anyway "
    "once more than 10% of its steps (and more than one) were skipped.",
)
@click.option(
    "--fused-adamw/--no-fused-adamw",
    default=None,
    help="AdamW's fused implementation (one kernel for the whole update; torch's "
    "recommendation on CUDA). Default: on for CUDA except with fp16, off elsewhere (the CPU keeps "
    "torch's for-loop AdamW); run.json's runtime records the choice.",
)
@click.option(
    "--grad-checkpointing",
    is_flag=True,
    help="Recompute encoder activations in the backward pass: less activation memory, about "
    "one extra forward of compute.",
)
@click.option(
    "--compile",
    is_flag=True,
    help="torch.compile the model's forward (slow first steps; pays off on long GPU runs).",
)
@click.option(
    "--fsdp",
    is_flag=True,
    help="Shard the model over the processes (FSDP2, per transformer block): weights, "
    "gradients and AdamW state take 1/N of the memory per process, and so do the frozen "
    "models a method holds (previous-task, teacher, momentum) and its per-parameter state. "
    "Trains what the run without it trains; checkpoints are the same whole-model files. "
    "Not with fp16, --compile or adapters (--tune lora/dora/vera). docs/scaling.md: Models "
    "beyond one GPU.",
)
@click.option(
    "--budget",
    default=None,
    metavar="SPEC",
    help="Train to a compute budget instead of full epochs: samples=N, tflops=N or maf=N "
    "(FoMo-in-Flux's memory-adjusted TFLOPs: FLOPs of a step plus the end-of-task work, times "
    "memory / full fine-tuning's memory on the same model) for the whole stream (shared by "
    "the tasks: maf equally, samples/tflops by training pairs), or N/task for each task. Each "
    "task's steps = its budget / the measured cost of one of its steps; --epochs stays an "
    "upper bound. docs/compute.md: Comparing at equal compute.",
)
@click.option(
    "--budget-arg",
    "budget_arg",
    multiple=True,
    metavar="NAME=VALUE",
    help="How --budget counts (defaults: maf = FoMo-in-Flux's MAF, samples / tflops = cvl's): "
    "split=equal|pairs (the stream's budget over the tasks: equal, maf; by training pairs), "
    "extras=step|task|none (end-of-task work charged to every step, maf; once per task; not "
    "charged), rounding=nearest|floor (maf: nearest); maf only: reference=full|tune (full "
    "fine-tuning of the same model, or the run's own --tune), memory=auto|device|tensors|"
    "allocated. Repeatable.",
)
@click.option(
    "--mixture",
    default=None,
    metavar="task=A,buffer=B,pretrain=C",
    help="Draw every global batch in set shares (summing to 1) from the task, the replay buffer "
    "(--buffer) and a pretraining source (--pretrain-data), as FoMo-in-Flux's data_mixture: "
    "floor(batch × share) each, the rest one by one in the order pretrain, task, buffer; with "
    "no buffer items yet (the first task) the buffer's part goes to the task and pretrain. An "
    "epoch is one pass over the task's own items. docs/schedules.md: Data mixtures.",
)
@click.option(
    "--pretrain-data",
    default=None,
    type=click.Path(),
    help="The mixture's pretraining source: a cvl stream folder (every task's training pairs, "
    "e.g. the stream CLIP_0 was trained on) or a folder of webdataset .tar shards.",
)
@click.option(
    "--sync-bn",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "on", "off"]),
    help="BatchNorm statistics with several processes (models with BatchNorm: the tiny and RN "
    "CLIPs): on = over the global batch, so N processes x batch B train as 1 x N*B (torch's "
    "SyncBatchNorm on GPUs, cvl's all_gather of the statistics on the CPU); off = per process "
    "(plain DDP); auto = on with CUDA, off elsewhere, with a note of the size of the effect "
    "(docs/scaling.md). Recorded in run.json; a run without it is auto.",
)
@device_option
@deterministic_option
@click.option(
    "--config",
    "config_path",
    type=click.Path(),
    default=None,
    help="YAML recipe; explicit options override it.",
)
@click.option(
    "--force", is_flag=True, help="Continue an existing run folder even if the config changed."
)
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.pass_context
def train(
    ctx: click.Context,
    method_arg: tuple[str, ...],
    tune_arg: tuple[str, ...],
    budget_arg: tuple[str, ...],
    task_lr: tuple[str, ...],
    base_loss_arg: tuple[str, ...],
    config_path: str | None,
    force: bool,
    quiet: bool,
    **kw: Any,
) -> None:
    """Train METHOD on every task of a stream, in the stream's task order.

    Writes RUN/run.json (resolved config), RUN/init/ (initial weights), one checkpoint per
    finished task in RUN/tasks/NN-name/, and a mid-task checkpoint in RUN/last/. Rerunning
    the same command resumes where it stopped; a different config is refused unless --force.
    Multi-process: `torchrun --nproc_per_node N -m cvl train ...` or `accelerate launch
    --multi_gpu --num_processes N -m cvl train ...`.
    """
    from click.core import ParameterSource

    from cvl.train.config import parse_method_args, resolve
    from cvl.train.loop import Trainer

    overrides = {
        k: kw[k]
        for k in _OPTS
        if ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None) or config_path is None
    }
    overrides["method_args"] = parse_method_args(method_arg)
    overrides["tune_args"] = parse_method_args(tune_arg, "--tune-arg", raw=True)
    overrides["budget_args"] = parse_method_args(budget_arg, "--budget-arg", raw=True)
    overrides["task_lr"] = parse_method_args(task_lr, "--task-lr")
    overrides["base_loss_args"] = parse_method_args(base_loss_arg, "--base-loss-arg")
    cfg = resolve(config_path, overrides)
    Trainer(cfg, force=force, progress=not quiet).run()
