"""Learning-rate schedules (`cvl train --lr-schedule NAME`): per task, across the stream, and
FoMo-in-Flux's meta-schedules.

Every schedule is a multiplier m of `--lr` at optimizer step n of a task, computed from the
task's place in the stream (`TaskPosition`: which trained task it is, its steps, the steps
the earlier tasks trained, the stream plan), never from saved state alone: a resumed run
rebuilds the same function and `LambdaLR` restores n.

Notation: S = the task's steps, k = its index among the run's trained tasks (FoMo's task
counter), W = its warm-up steps, C = its cool-down steps, r = --min-lr / --lr. The warm-up
is `--warmup` on the first trained task and `--warmup-later` (default: `--warmup`) on the
others (TiC-CLIP's warm start: a fresh optimizer each task and a shorter warm-up after the
first; its runs use 10,000 steps on the first and 2,000 on the later ones). A fraction
(< 1) is of the task's steps — rounded as cvl's `cosine` always did (round) and as FoMo's code
does (ceil) for FoMo's schedules —, a value >= 1 is steps.

- `cosine` (default, cvl's): linear warm-up, then cosine from --lr to --min-lr, restarted
  every task (`cosine_schedule`).
- `stream-cosine`: ONE warm-up + cosine over the whole stream (`stream_multiplier`).

FoMo-in-Flux (Roth et al. 2024, pseudope/fomo_in_flux
`continual_lib/utils/base_continual_learner.py` `initialize_optimizer_and_scheduler`), exactly
as its code computes them (its `min_lr` = lr · cosine_lr_mul is --min-lr; its rsqrt floor
`warmup_init_lr` is --min-lr too); the "meta-schedules" set each task's peak from its place
in the stream:

- `cosine-fomo` (`cosine_with_linear_warmup`): n < W: (n+1)/W; else
  r + (1-r)·½(1 + cos(π·(n-W+1)/(S-W))) — unlike `cosine`, W = ceil and the decay reaches
  the floor at the task's last step.
- `cosine-ar` (`cosine_with_linear_warmup_and_recovery`, its default recovery_mode
  autoregressive): the same shape from a peak p_k = r + (1-r)·½(1 + cos(π·(D_<k + 1)/D_≤k)),
  D_i = S_i - W_i (FoMo: k(S-W)+1 over (k+1)(S-W)): the value a cosine over all decay steps
  so far has where task k's begin. m = p_k·(n+1)/W, then r + ½(1 + cos(π·(n-W+1)/(S-W)))·(p_k-r).
- `cosine-dyn` (`..._and_dynamic_recovery`): warm-up to p_k as `cosine-ar`, then the
  `cosine-fomo` curve of a task spanning every step so far: G = S_<k + n over H = S_≤k steps
  (its warm-up the --warmup rule applied to H).
- `rsqrt` (`rsqrt`): n < W: (n+1)/W; then r + sqrt(W/n)·(1-r); in the last C steps
  (`--cooldown`) that value · (C - (n-S+C) - 1)/C, reaching 0 at the last step.
- `rsqrt-ar` (`rsqrt_with_recovery`, recovery_mode autoregressive): the same shape from the
  peak p_k = r + sqrt(W_≤k / (S_<k + W_k))·(1-r) (FoMo: sqrt((k+1)W / (kS+W))).
- `rsqrt-cont` (recovery_mode continued): peak p_k = r + sqrt(W_0 / (W_0 + Σ_{i<k}(S_i-C_i-W_i)))
  ·(1-r), the value of ONE rsqrt curve where task k starts when warm-ups after the first and
  cool-downs are left out (FoMo: k(S-C) - (k-1)W).
- Both peaks are capped at 1 (--lr): a cap only where FoMo's domain ends, a warm-up (plus
  cool-down) longer than its task (W > S - C). There FoMo's code raises the peak above --lr
  (rsqrt-ar: (k+1)W > kS+W when W > S), and rsqrt-cont's denominator k(S-C) - (k-1)W falls
  below W, then to 0 or below (a division by zero or the root of a negative); cvl's choice.

With equal tasks (FoMo's setting: every task n_samples / batch steps, one warm-up fraction)
the sums are FoMo's k·S terms exactly; with unequal tasks (cvl: task sizes, `--budget`) they
are the trained steps of the earlier tasks. Not built: FoMo's recovery_mode `recovered` (its
warm-up peak adds the step offset twice, k(S-C-W) + k(S-C-W), against once in the decay that
follows, so the rate jumps at the warm-up's end: the code contradicts itself) and `wsd`,
which its list of schedules names but no branch of its code implements.

`stream-cosine` needs the stream's length before it trains: the plan (`stream_plan`) gives
each trained task a planned part P_i — its steps as the loop computes them (epochs × batches
of its own items, --max-steps-per-task), or under `--budget` its budget share (the steps a
tflops/maf budget buys are known only after the task's cost is measured). Step n of task k
sits at v = P_<k + P_k·n/S on a cosine over T = ΣP (warm-up: the first `--warmup` fraction of
T, or `--warmup` steps of the first task). Where a task trains the steps planned (no budget,
no buffer mixed into the task's data without `--mixture`; `samples=` budgets) v is the
global step; where it does not, the task still covers exactly its part of the curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cvl.errors import CvlError

SCHEDULES = (
    "cosine",
    "stream-cosine",
    "cosine-fomo",
    "cosine-ar",
    "cosine-dyn",
    "rsqrt",
    "rsqrt-ar",
    "rsqrt-cont",
)
STREAM_LEVEL = ("stream-cosine",)  # need the plan of the whole stream


@dataclass(frozen=True)
class TaskPosition:
    """Where a task sits in the stream, for its schedule.

    k: its index among the run's trained tasks; steps: its optimizer steps; before: the steps
    each earlier trained task trained; plan: the planned part of every trained task
    (`stream_plan`, stream-level schedules only); restarts: every task starts from the
    initial weights (`joint restart=true`, TiC-CLIP's Oracle), so each warms up as the first."""

    k: int = 0
    steps: int = 1
    before: tuple[int, ...] = ()
    plan: tuple[float, ...] | None = None
    restarts: bool = False


def cosine_schedule(total: int, warmup: float, base_lr: float, min_lr: float):
    """LR multiplier: linear warm-up, then cosine from base_lr to min_lr over `total` steps."""
    w = int(round(warmup * total)) if warmup < 1 else int(warmup)
    floor = min_lr / base_lr if base_lr > 0 else 0.0

    def f(step: int) -> float:
        if w > 0 and step < w:
            return (step + 1) / w
        p = (step - w) / max(1, total - w)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))

    return f


def _steps(frac_or_steps: float, total: int) -> int:
    """FoMo's rule: a fraction (< 1) of `total`, rounded up; else a step count."""
    return int(math.ceil(frac_or_steps * total)) if frac_or_steps < 1 else int(frac_or_steps)


def _half_cos(x: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * x))


def warmup_of(cfg: Any, k: int, restarts: bool = False) -> float:
    """The task's `--warmup` value: `--warmup-later` (if set) for every task that starts from
    trained weights (after the first, unless every task `restarts` from the initial ones)."""
    later = getattr(cfg, "warmup_later", None)
    return cfg.warmup if k == 0 or restarts or later is None else later


def lr_multiplier(cfg: Any, pos: TaskPosition) -> Callable[[int], float]:
    """The task's multiplier of --lr at its step n, for `cfg.lr_schedule` (module doc)."""
    name = getattr(cfg, "lr_schedule", "cosine")
    r = cfg.min_lr / cfg.lr if cfg.lr > 0 else 0.0
    S, k = max(1, pos.steps), pos.k
    w = warmup_of(cfg, k, pos.restarts)
    if name == "cosine":
        return cosine_schedule(S, w, cfg.lr, cfg.min_lr)
    if name == "stream-cosine":
        return stream_multiplier(cfg, pos, r)
    W = _steps(w, S)
    prev_w = [_steps(warmup_of(cfg, i, pos.restarts), s) for i, s in enumerate(pos.before)]
    if name in ("cosine-fomo", "cosine-ar", "cosine-dyn"):
        peak = 1.0
        if name != "cosine-fomo" and k > 0:
            done = sum(s - pw for s, pw in zip(pos.before, prev_w))
            peak = r + (1 - r) * _half_cos((done + 1) / max(1, done + S - W))
        if name == "cosine-dyn":
            return _dynamic(cfg, pos, W, peak, r)
        return _fomo_cosine(S, W, peak, r)
    if name in ("rsqrt", "rsqrt-ar", "rsqrt-cont"):
        if W < 1:
            raise CvlError(f"--lr-schedule {name} needs a warm-up (--warmup > 0): rsqrt = √(W/n)")
        C = _steps(getattr(cfg, "cooldown", 0.1), S)
        peak = 1.0
        if k > 0 and name == "rsqrt-ar":
            peak = r + (1 - r) * math.sqrt(min(1.0, (sum(prev_w) + W) / (sum(pos.before) + W)))
        elif k > 0 and name == "rsqrt-cont":
            cool = [_steps(getattr(cfg, "cooldown", 0.1), s) for s in pos.before]
            seen = prev_w[0] + sum(s - c - pw for s, c, pw in zip(pos.before, cool, prev_w))
            peak = r + (1 - r) * math.sqrt(prev_w[0] / max(seen, prev_w[0]))
        return _rsqrt(S, W, C, peak, r)
    raise CvlError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got '{name}'")


def _fomo_cosine(S: int, W: int, peak: float, r: float) -> Callable[[int], float]:
    def f(n: int) -> float:
        if W and n < W:
            return peak * (n + 1) / W
        return r + _half_cos((n - W + 1) / max(1, S - W)) * (peak - r)

    return f


def _dynamic(cfg: Any, pos: TaskPosition, W: int, peak: float, r: float):
    """`cosine-dyn` after the warm-up: FoMo's cosine over H = all steps so far, at G."""
    before = sum(pos.before)
    H = before + max(1, pos.steps)
    Wb = _steps(cfg.warmup, H)
    big = _fomo_cosine(H, Wb, 1.0, r)

    def f(n: int) -> float:
        if W and n < W:
            return peak * (n + 1) / W
        return big(before + n)

    return f


def _rsqrt(S: int, W: int, C: int, peak: float, r: float) -> Callable[[int], float]:
    start = S - C

    def f(n: int) -> float:
        if n < W:
            return peak * (n + 1) / W
        value = r + math.sqrt(W / n) * (peak - r)
        if C and n >= start:
            return value * (C - (n - start) - 1) / C
        return value

    return f


def stream_multiplier(cfg: Any, pos: TaskPosition, r: float) -> Callable[[int], float]:
    """`stream-cosine`: warm-up + cosine over the planned stream (module doc)."""
    plan = pos.plan
    if not plan or pos.k >= len(plan):
        raise CvlError("--lr-schedule stream-cosine: no stream plan for this task")
    S = max(1, pos.steps)
    T = float(sum(plan))
    start = float(sum(plan[: pos.k]))
    unit = plan[pos.k] / S  # one step of this task, in plan units
    if cfg.warmup < 1:
        Ws = cfg.warmup * T
    else:
        first = pos.before[0] if pos.before else S
        Ws = cfg.warmup * plan[0] / max(1, first)

    def f(n: int) -> float:
        v = start + unit * n
        if Ws > 0 and v < Ws:
            return min(1.0, (v + unit) / Ws)
        p = (v - Ws) / (T - Ws) if T > Ws else 1.0
        return r + (1 - r) * _half_cos(min(1.0, max(0.0, p)))

    return f


def check_schedule(cfg: Any) -> None:
    """Clear one-line errors for schedule options no run could use."""
    name = getattr(cfg, "lr_schedule", "cosine")
    if name not in SCHEDULES:
        raise CvlError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got '{name}'")
    for opt in ("warmup", "warmup_later", "cooldown"):
        v = getattr(cfg, opt, None)
        if v is not None and v < 0:
            raise CvlError(f"--{opt.replace('_', '-')} must be >= 0, got {v}")
    later = getattr(cfg, "warmup_later", None)
    if name.startswith("rsqrt") and (cfg.warmup <= 0 or later == 0):
        raise CvlError(f"--lr-schedule {name} needs a warm-up (--warmup > 0): rsqrt = √(W/n)")


def check_task_rates(cfg: Any, pos: TaskPosition, task: str) -> None:
    """Refuse a schedule that cannot train task `task` as asked: an rsqrt cool-down longer
    than the task, or no step at a non-zero rate (FoMo's cosines reach the floor at a task's
    last step, so a one-step task without warm-up, or an `-ar` / `-dyn` peak of 0, trains
    nothing at --min-lr 0)."""
    name = getattr(cfg, "lr_schedule", "cosine")
    S = pos.steps
    if S <= 0:
        return
    if name.startswith("rsqrt"):
        C = _steps(getattr(cfg, "cooldown", 0.1), S)
        if C > S:
            raise CvlError(
                f"--cooldown {cfg.cooldown:g}: a cool-down of {C} steps is longer than task "
                f"{task}'s {S} step(s) (--lr-schedule {name}); give a fraction (< 1) of the "
                "task or fewer steps"
            )
    f = lr_multiplier(cfg, pos)
    if not any(f(n) > 0 for n in range(S)):
        raise CvlError(
            f"--lr-schedule {name}: task {task} would train all its {S} step(s) at a learning "
            "rate of 0 (--min-lr 0); add a warm-up (--warmup), a floor (--min-lr) or steps, "
            "or use another schedule"
        )


def check_planned_rates(
    cfg: Any, planned: Sequence[int | None], names: Sequence[str], restarts: bool = False
) -> None:
    """`check_task_rates` before the run starts, for the trained tasks whose steps are known
    (`planned[k]`, None: decided by the loop, which checks it and every later one then);
    `restarts`: every task starts from the initial weights (`TaskPosition`)."""
    name = getattr(cfg, "lr_schedule", "cosine")
    if name in STREAM_LEVEL or getattr(cfg, "budget", None):
        return  # the plan of the whole stream / the steps a budget buys: the loop's
    for k, steps in enumerate(planned):
        if steps is None:
            return
        before = tuple(int(n or 0) for n in planned[:k])
        check_task_rates(cfg, TaskPosition(k, steps, before, restarts=restarts), names[k])


# -- the stream plan ---------------------------------------------------------------------------
def task_steps(per_epoch: int, cfg: Any) -> int:
    """A task's optimizer steps without --budget (`cvl.train.plan.steps_of`)."""
    from cvl.train.plan import steps_of

    return steps_of(per_epoch, cfg)


def stream_plan(trainer: Any, indices: Sequence[int]) -> tuple[float, ...]:
    """The planned part of each trained task (module doc): its budget share under --budget,
    else its steps from its own items (the method's `own_entries`), the global batch and the
    mixture's task items per batch (the first trained task has no buffer items)."""
    from dataclasses import replace

    from cvl.methods.base import TaskContext
    from cvl.train.budgetspec import task_share

    cfg, order = trainer.cfg, list(trainer.manifest.task_order)
    single = getattr(trainer.method, "single_task", False)
    if trainer.budget is not None:
        counts = {i: trainer.manifest.tasks[order[i]].train.count for i in indices}
        split = trainer.budget_opts["split"]  # maf: equal (FoMo-in-Flux), else by pairs
        seen = getattr(trainer.method, "budget_seen", False)  # the Oracle: tasks 0..t
        return tuple(
            task_share(trainer.budget, counts, i, len(order), single, split, seen) for i in indices
        )
    gb = cfg.batch_size * trainer.acc.num_processes
    ctx = TaskContext(
        model=None,
        accelerator=trainer.acc,
        config=cfg,
        manifest=trainer.manifest,
        run_dir=trainer.out,
        services=trainer,
    )
    plan = []
    for k, i in enumerate(indices):
        c = replace(
            ctx, task_index=i, task_name=order[i], task_entries=trainer.entries_of(order[i])
        )
        n = len(trainer.method.own_entries(c))
        mix = getattr(trainer, "mixture", None)
        per = n // gb if mix is None else n // mix.sizes(gb, bool(cfg.buffer) and k > 0)["task"]
        plan.append(float(task_steps(max(1, per), cfg)))
    return tuple(plan)


PER_TASK = ("cosine", "cosine-fomo", "rsqrt")  # need nothing of the earlier tasks


def task_position(trainer: Any, ti: int, steps: int) -> TaskPosition:
    """Task `ti`'s place for its schedule: its index among the trained tasks, the steps the
    earlier ones trained (their task.json, written when each finished: the same numbers on a
    resume) and, for a stream-level schedule, the stream plan (computed once per run)."""
    from cvl.io import read_json
    from cvl.runs import task_dir

    name = getattr(trainer.cfg, "lr_schedule", "cosine")
    k = trainer.indices.index(ti)
    restarts = bool(getattr(trainer.method, "restarts", False))
    if name in PER_TASK:
        return TaskPosition(k, steps, restarts=restarts)
    order = list(trainer.manifest.task_order)
    before = tuple(
        int(read_json(task_dir(trainer.out, i, order[i]) / "task.json")["steps"])
        for i in trainer.indices[:k]
    )
    plan = None
    if name in STREAM_LEVEL:
        if getattr(trainer, "_stream_plan", None) is None:
            trainer._stream_plan = stream_plan(trainer, trainer.indices)
        plan = trainer._stream_plan
    return TaskPosition(k, steps, before, plan, restarts)


def schedule_record(trainer: Any) -> dict[str, Any]:
    """run.json's "lr_schedule": the schedule, its warm-ups and (stream-level) the plan."""
    cfg = trainer.cfg
    name = getattr(cfg, "lr_schedule", "cosine")
    rec: dict[str, Any] = {"name": name, "warmup": cfg.warmup, "warmup_later": cfg.warmup_later}
    if name.startswith("rsqrt"):
        rec["cooldown"] = cfg.cooldown
    if name in STREAM_LEVEL:
        single = getattr(trainer.method, "single_task", False)
        n = len(trainer.manifest.task_order)
        indices = [n - 1] if single else list(range(n))
        if getattr(trainer, "_stream_plan", None) is None:
            trainer._stream_plan = stream_plan(trainer, indices)
        rec["plan"] = list(trainer._stream_plan)
        rec["plan_unit"] = "budget share" if trainer.budget is not None else "steps"
    return rec
