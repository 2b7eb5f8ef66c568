"""Training configuration: dataclass defaults < YAML file (`--config`) < explicit CLI options.

The resolved config is stored in `run.json`; rerunning `cvl train` on the same folder compares
the parts that change results (`RESULT_KEYS`) and refuses a different config unless --force.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cvl.checks import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
    WORKERS,
    Num,
    to_bool,
)
from cvl.errors import CvlError


@dataclass
class TrainConfig:
    """Everything `cvl train` needs; field names are the YAML keys and the CLI option names."""

    stream: str = ""
    out: str = ""
    method: str = "seqft"
    method_args: dict[str, Any] = field(default_factory=dict)
    model: str = "clip"
    model_config: str = "tiny"
    pretrained: str | None = None
    init_run: str | None = None  # a cvl run (last task's weights) or task folder to start from
    epochs: int = 2
    batch_size: int = 64  # per process; the global batch is batch_size × processes
    lr: float = 5e-4
    min_lr: float = 0.0
    weight_decay: float = 0.1
    warmup: float = 0.0  # fraction of the task's optimizer steps (< 1) or a step count (≥ 1)
    warmup_later: float | None = None  # the warm-up of every task after the first (TiC-CLIP)
    lr_schedule: str = "cosine"  # per task, over the stream, FoMo's (cvl.train.schedules)
    cooldown: float = 0.1  # rsqrt schedules: linear cool-down, fraction (< 1) or steps (≥ 1)
    optimizer: str = "adamw"  # adamw | lamb (timm's LAMB: IncCLIP trains with it)
    fused_adamw: bool | None = None  # AdamW's fused kernel; None = on CUDA (cvl.train.optim)
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    grad_clip: float = 0.0  # max global grad norm; 0 = off
    grad_accum: int = 1
    accum_mode: str = "plain"  # plain | cached: what --grad-accum K trains (cvl.train.accum)
    precision: str = "no"  # no | bf16 | fp16
    seed: int = 0
    augment: str = "openclip"  # openclip | ctp | none
    buffer: str | None = None
    buffer_size: int = 0
    tune: str = "full"  # which parameters train: cvl.models.tune.MODES (LoRA, BitFit, ...)
    tune_args: dict[str, Any] = field(default_factory=dict)  # rank, alpha, targets, bn_stats
    workers: int = -1  # loader processes per training process: -1 = from the CPU count, 0 = none
    shuffle_block: int = 1  # 1 = a global shuffle; K > 1 = shard-local blocks of K (data.order)
    # the block order: "recut" (blocks re-cut and keyed per epoch) or "fixed" (runs started
    # before re-cutting existed resume with it; not a CLI option)
    block_order: str = "recut"
    io_concurrency: int = 0  # remote ranges in flight per loader process (0: the default, 64)
    shard_cache: str | None = (
        None  # a local folder caching whole remote shards (cvl.data.shardcache)
    )
    shard_cache_gb: float = 0.0  # its size bound (0: the default, 64 GB)
    checkpoint_every: int = 50  # optimizer steps between mid-task checkpoints (0 = per task only)
    log_every: int = 10  # optimizer steps per train_log.jsonl line (each averages its steps)
    log_with: str = "auto"  # auto (tensorboard if installed) | tensorboard | wandb | none
    max_steps_per_task: int = 0  # debugging / smoke tests: stop each task early (0 = off)
    steps_per_task: int = (
        0  # train every task exactly N optimizer steps (epochs as needed; 0 = by --epochs)
    )
    task_lr: dict[str, float] = field(default_factory=dict)  # task name -> peak lr (else --lr)
    base_loss: str = "itc"  # itc | class-ce (cvl.methods.base.BASE_LOSSES)
    base_loss_args: dict[str, Any] = field(
        default_factory=dict
    )  # class-ce: scale, smoothing, template
    select: str = "auto"  # auto | last | best-val: which weights end a task (cvl.train.selection)
    skip_nonfinite: int = 0  # optimizer steps with a NaN/Inf loss to skip before stopping
    grad_checkpointing: bool = False  # recompute activations in backward (memory for compute)
    compile: bool = False  # torch.compile the model's forward (training step only)
    fsdp: bool = False  # FSDP2: shard weights, gradients, optimizer state (cvl.train.fsdp)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (cvl.device); multi-process: auto|cuda|cpu
    deterministic: bool | None = None  # bit-reproducible kernels; None = per device (cvl.device)
    sync_bn: str = "auto"  # BatchNorm statistics of N processes: auto | on | off (batchnorm)
    budget: str | None = None  # samples=N | tflops=N | maf=N [/task] (cvl.train.budget)
    budget_args: dict[str, Any] = field(default_factory=dict)  # split, extras, rounding, ...
    mixture: str | None = None  # task=A,buffer=B,pretrain=C shares of each batch (cvl.data.mixture)
    pretrain_data: str | None = None  # the mixture's pretraining source: a stream or shards

    def validate(self) -> TrainConfig:
        """Clear one-line errors for values no run could use or that would train wrongly or
        not at all: every number against its rule in `LIMITS` (finite, in range), switches
        as real booleans, choices, combinations (a floor above the peak rate, ...)."""
        for k, rule in LIMITS.items():
            setattr(self, k, rule.check(getattr(self, k), option_name(k)))
        if self.min_lr > self.lr:
            raise CvlError(
                f"--min-lr {self.min_lr:g} is above --lr {self.lr:g}: the cosine schedule would "
                "raise the rate instead of lowering it"
            )
        for k in ("grad_checkpointing", "compile", "fsdp"):
            setattr(self, k, to_bool(getattr(self, k), option_name(k)))
        if self.steps_per_task and self.budget:
            raise CvlError(
                "give --steps-per-task or --budget, not both (both fix each task's steps)"
            )
        if not isinstance(self.task_lr, dict):
            raise CvlError("task_lr must be a mapping of task name: learning rate")
        self.task_lr = {
            str(k): POSITIVE_FLOAT.check(v, f"--task-lr {k}") for k, v in self.task_lr.items()
        }
        from cvl.methods.base import resolve_base_loss_args

        args = resolve_base_loss_args(self.base_loss, self.base_loss_args)
        self.base_loss_args = {k: args[k] for k in self.base_loss_args}  # typed
        if self.model not in ("clip", "fusion"):
            raise CvlError(f"--model must be clip or fusion, got '{self.model}'")
        if self.precision not in ("no", "bf16", "fp16"):
            raise CvlError(f"--precision must be no, bf16 or fp16, got '{self.precision}'")
        if self.optimizer not in ("adamw", "lamb"):
            raise CvlError(f"--optimizer must be adamw or lamb, got '{self.optimizer}'")
        if self.augment not in ("openclip", "ctp", "none"):
            raise CvlError(f"--augment must be openclip, ctp or none, got '{self.augment}'")
        from cvl.train.selection import SELECT_CHOICES

        if self.select not in SELECT_CHOICES:
            raise CvlError(
                f"--select must be one of {', '.join(SELECT_CHOICES)}, got '{self.select}'"
            )
        if self.deterministic is not None:
            self.deterministic = to_bool(self.deterministic, "--deterministic")
        from cvl.train.batchnorm import SYNC_BN_CHOICES

        if isinstance(self.sync_bn, bool):  # YAML 1.1 reads a bare on / off as a boolean
            self.sync_bn = "on" if self.sync_bn else "off"
        if self.sync_bn not in SYNC_BN_CHOICES:
            raise CvlError(
                f"--sync-bn must be one of {', '.join(SYNC_BN_CHOICES)}, got '{self.sync_bn}'"
            )
        from cvl.train.accum import ACCUM_MODES

        if self.accum_mode not in ACCUM_MODES:
            raise CvlError(
                f"--accum-mode must be one of {', '.join(ACCUM_MODES)}, got '{self.accum_mode}'"
            )
        if self.fused_adamw is not None:
            self.fused_adamw = to_bool(self.fused_adamw, "--fused-adamw")
            if self.fused_adamw and self.optimizer != "adamw":
                raise CvlError(f"--fused-adamw is AdamW's; --optimizer is {self.optimizer}")
            if self.fused_adamw and self.precision == "fp16":
                raise CvlError(
                    "--fused-adamw with --precision fp16: the loss scaler would skip overflowed "
                    "steps inside the fused kernel, unseen by the loop; use bf16 or drop it"
                )
        if self.warmup_later is not None:
            self.warmup_later = NON_NEGATIVE_FLOAT.check(self.warmup_later, "--warmup-later")
        from cvl.train.budget import budget_options, parse_budget

        b = parse_budget(self.budget)  # a clear error for a malformed spec
        self.budget = b.spec if b is not None else None  # '' (or blanks) is no budget
        opts = budget_options(b, self.budget_args)  # ... and for unknown or misplaced options
        self.budget_args = {k: opts[k] for k in self.budget_args}  # normalised: "Equal" -> equal
        if self.pretrained and self.init_run:
            raise CvlError("give --pretrained FILE or --init-run RUN, not both")
        from cvl.models.tune import Tuning

        tuning = Tuning(self.tune, self.tune_args)  # clear errors for unknown modes, arguments
        self.tune_args = {k: tuning.args[k] for k in self.tune_args}  # typed: "16" -> 16
        from cvl.train.schedules import check_schedule

        check_schedule(self)
        self._check_mixture()
        self._check_buffer()
        if not self.stream:
            raise CvlError("--stream is required")
        if not self.out:
            raise CvlError("--out is required")
        return self

    def _check_mixture(self) -> None:
        """`--mixture` and its sources agree (a share needs its source, a source its share);
        the spec is stored in its canonical form."""
        from cvl.data.mixture import mixture_spec, parse_mixture

        shares = parse_mixture(self.mixture)
        if shares is None:
            if self.pretrain_data:
                raise CvlError(
                    "--pretrain-data is the pretraining source of a --mixture: add --mixture "
                    "task=...,pretrain=..."
                )
            self.mixture = None
            return
        self.mixture = mixture_spec(shares)
        if shares["pretrain"] > 0 and not self.pretrain_data:
            raise CvlError("--mixture gives the pretraining source a share: add --pretrain-data")
        if shares["pretrain"] == 0 and self.pretrain_data:
            raise CvlError("--pretrain-data given, but --mixture gives it no share (pretrain=...)")
        if shares["buffer"] > 0 and not self.buffer:
            raise CvlError("--mixture gives the buffer a share: add --buffer KIND --buffer-size N")
        if shares["buffer"] == 0 and self.buffer:
            raise CvlError(
                f"--buffer {self.buffer} with a --mixture that gives it no share: its items would "
                "never be replayed (add buffer=SHARE to --mixture, or drop --buffer)"
            )

    def _check_buffer(self) -> None:
        from cvl.methods.buffers import BUFFERS, buffer_names

        names = buffer_names()
        if self.buffer_size and not self.buffer:
            raise CvlError(f"--buffer-size given without --buffer ({', '.join(names)})")
        if not self.buffer:
            return
        if self.buffer not in names:
            raise CvlError(f"unknown buffer '{self.buffer}' (available: {', '.join(names)})")
        if getattr(BUFFERS[self.buffer], "unbounded", False):
            if self.buffer_size:
                raise CvlError(
                    f"--buffer {self.buffer} keeps every past pair: it takes no --buffer-size"
                )
        elif self.buffer_size <= 0:
            raise CvlError(f"--buffer {self.buffer} needs a positive --buffer-size")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Fields only a `--config` YAML sets (the CLI has no option for them).
YAML_ONLY = {"beta1", "beta2", "eps", "method_args", "tune_args"}


def option_name(key: str) -> str:
    """How messages name a config key: its `cvl train` option (`min_lr` -> `--min-lr`; the
    YAML key is the same with underscores), or `eps (--config)` for a YAML-only field."""
    return f"{key} (--config)" if key in YAML_ONLY else "--" + key.replace("_", "-")


# The rule of every numeric field (`cvl.checks.Num`): the click options of `cvl train` use
# them as their types and `TrainConfig.validate` applies them to the resolved config (YAML
# values included), so NaN / inf and out-of-range values are refused before anything runs.
LIMITS: dict[str, Num] = {
    "epochs": POSITIVE_INT,
    "batch_size": POSITIVE_INT,
    "lr": POSITIVE_FLOAT,
    "min_lr": NON_NEGATIVE_FLOAT,
    "weight_decay": NON_NEGATIVE_FLOAT,
    "warmup": NON_NEGATIVE_FLOAT,
    "cooldown": NON_NEGATIVE_FLOAT,
    "beta1": Num(float, 0, 1, hi_open=True),
    "beta2": Num(float, 0, 1, hi_open=True),
    "eps": POSITIVE_FLOAT,
    "grad_clip": NON_NEGATIVE_FLOAT,
    "grad_accum": POSITIVE_INT,
    "seed": SEED,
    "buffer_size": NON_NEGATIVE_INT,
    "workers": WORKERS,
    "shuffle_block": POSITIVE_INT,
    "io_concurrency": NON_NEGATIVE_INT,
    "shard_cache_gb": NON_NEGATIVE_FLOAT,
    "checkpoint_every": NON_NEGATIVE_INT,
    "log_every": POSITIVE_INT,
    "max_steps_per_task": NON_NEGATIVE_INT,
    "steps_per_task": NON_NEGATIVE_INT,
    "skip_nonfinite": NON_NEGATIVE_INT,
}


# Keys that do not change what is computed (a resumed run may change them freely).
# skip_nonfinite: a run stopped by a NaN must be resumable with a skip allowance added.
# grad_checkpointing, compile and fsdp compute the same function (up to floating-point rounding).
# device and deterministic change where and how reproducibly the same maths runs, not what it
# is: a run may move machines or switch modes (run.json's "runtime" records each change);
# fused_adamw too (the same update in one kernel, up to floating-point rounding).
NON_RESULT_KEYS = {
    "out",
    "workers",
    "io_concurrency",
    "shard_cache",
    "shard_cache_gb",
    "checkpoint_every",
    "log_every",
    "log_with",
    "stream",
    "skip_nonfinite",
    "grad_checkpointing",
    "compile",
    "fsdp",
    "device",
    "deterministic",
    "fused_adamw",
}


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A recipe YAML as a dict of TrainConfig fields (unknown keys are an error; keys
    starting with `recipe_` are the recipe scripts' own, recipes/lib.sh, and left out)."""
    p = Path(path)
    if not p.is_file():
        raise CvlError(f"--config {p}: file not found")
    try:
        d = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise CvlError(f"--config {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(d, dict):
        raise CvlError(f"--config {p}: must be a mapping of option: value")
    d = {k: v for k, v in d.items() if not str(k).startswith("recipe_")}
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    bad = sorted(set(d) - known)
    if bad:
        raise CvlError(f"--config {p}: unknown key(s) {', '.join(bad)}")
    return d


def resolve(yaml_path: str | None, overrides: dict[str, Any]) -> TrainConfig:
    """Defaults, then the YAML file, then explicit CLI overrides (method_args merged)."""
    base: dict[str, Any] = {}
    if yaml_path:
        base = load_yaml(yaml_path)
    merged = {}
    for key in ("method_args", "tune_args", "budget_args", "base_loss_args", "task_lr"):
        merged[key] = dict(base.get(key) or {})  # NAME=VALUE maps: the CLI adds to the YAML's
        merged[key].update(overrides.pop(key, None) or {})
    base.update(overrides)
    base.update(merged)
    cfg = TrainConfig()
    for k, v in base.items():
        setattr(cfg, k, v)  # typed and checked by validate() (LIMITS, to_bool)
    return cfg.validate()


def parse_method_args(
    items: tuple[str, ...], option: str = "--method-arg", raw: bool = False
) -> dict[str, Any]:
    """`k=v` strings (values parsed as YAML scalars: 1e-3, true, 20; `raw`: kept as strings,
    for values such as `*visual*` that YAML would misread, typed by their consumer)."""
    out = {}
    for it in items:
        if "=" not in it:
            raise CvlError(f"{option} '{it}': expected NAME=VALUE")
        k, v = it.split("=", 1)
        if raw:
            out[k.strip()] = v
            continue
        try:
            out[k.strip()] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise CvlError(f"{option} '{it}': {str(e).splitlines()[0]}") from None
    return out


# Result-changing keys a `--force` resume may change in the middle of a task: the optimizer's
# and the schedule's settings, applied from the resumed step on (the optimizer's moments and
# the step count carry on). Any other change needs the task to start again (delete last/).
MIDTASK_KEYS = {
    "lr",
    "task_lr",
    "min_lr",
    "warmup",
    "warmup_later",
    "lr_schedule",
    "cooldown",
    "weight_decay",
    "beta1",
    "beta2",
    "eps",
    "grad_clip",
}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (old, new)} for result-changing keys that differ.

    Keys missing from `old` (a run written before the option existed) count as their default.
    """
    old = {**TrainConfig().to_json(), **old}
    keys = sorted((set(old) | set(new)) - NON_RESULT_KEYS)
    return {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Lines 'key: old -> new' for result-changing keys that differ (see `config_changes`)."""
    return [f"{k}: {a!r} -> {b!r}" for k, (a, b) in config_changes(old, new).items()]
