"""Weight-space merging: the one home of reading, writing and interpolating a model's weights,
of the merge operators, and of the base classes of the merging methods (`wise`, `ema_merge`,
`zs_merge`, `ft_merge`, `task_arith`, `ties`, `model_stock`; `ema_step` averages per step).

**Weights** are the model's floating-point parameters and buffers under their plain names
(`floating_state`), restricted to what `--tune` trains (all of them under `--tune full`; the
adapted weights under `lora`/`dora`, read as they compute; the biases under `bitfit`, ...).
FoMo-in-Flux merges the whole state dict (`continual_lib/merge.py`, every key): the tensors a
run does not train are equal in every model merged, so leaving them out gives the same result
(and keeps them bit-exact under α ≠ ½); LoRA/DoRA factors are not merged one by one (a merge
of B and A is not the merge of the weights B·A they compute), the adapted weights are; integer
buffers (BatchNorm's batch counter) keep the trained model's value. `write_` and
`interpolate_` change the weights in place; a model carrying adapters has them merged first
and gets a zero delta after (it then computes exactly the written weights).

**Statistics** (`statistics_names`: the floating buffers among the weights, e.g. BatchNorm's
running mean and variance) are measurements of the data a model saw, not weights. The
interpolation merges combine them like the weights (a convex combination: a valid variance);
the task-vector merges (`TaskVectorMerge`, `opcm`, `model_stock`: `statistics = "mean"`) leave
them out of the task vectors and deploy the mean of the statistics of the task models merged so
far (θ̂_0..θ̂_t), since θ_0 + λ·f(τ) of a variance can be negative (DARE-TIES and TALL masks
drove BatchNorm variances of the tiny ResNet CLIP below 0: NaN features). The sources merge ViTs
(no BatchNorm) and are silent here; the mean is what a uniform soup of the task models deploys.

**Merge operators** (`OPERATORS`, `merge_operator`): functions of a list of models (newest
first) and the initial weights, returning merged weights, as FoMo-in-Flux keeps every merge
behind one interface (`continual_lib/merge.py`: `BaseMerge.__call__(state_dicts,
zero_shot)`, built by `create_merge_instance`). Here: `interpolation` (its `Interpolation`:
Σ c_i·θ_i, equal coefficients unless given), `slerp` (its `SLERP`, two models), `task_arithmetic`,
`magmax`, `dare`, `dare_ties`, `breadcrumbs`, `tall_masks` (θ_0 + λ·merge of the task vectors
θ_i − θ_0; the arithmetic in `cvl.methods.merge_ops`, each citing its code). The methods keep
what they need of past tasks and call the same functions; `InterpolationMerge` takes the
pair operator by name (`interpolation` or `slerp`).

**LiNeS** (`lines=true` on any task-vector merge, `TaskVectorMerge`): the merged task vector is
scaled per tensor by α + β·ℓ/(L − 1) (ℓ its residual block, α outside the blocks) in place of
the merge's λ, as FoMo-in-Flux's `BaseLinesMerge` does for its task-vector merges.

**Merging in a continual stream** (TIME's framework, Dziadzio et al. 2025: where a task's
training starts, what is deployed). Notation: θ_0 = the run's initial weights (`init/`);
θ̂_t = the weights at the end of training task t (after the base method's `after_task`: the
"fine-tuned model" of task t); θ_t = the deployed weights of task t (what `tasks/NN-name/`
saves, what is evaluated); start_t = the weights task t trained from, set by `init`:

- `merged` (cvl's default contract): start_t = θ_{t−1} (θ_0 for t = 0);
- `finetuned`: start_t = θ̂_{t−1}, the previous task's un-merged weights (kept in the method's
  state; the deployed θ_{t−1} is only evaluated and used as the base method's previous model);
- `base`: start_t = θ_0 for every task (each task model fine-tuned from the pre-trained one,
  as task arithmetic, TIES and Model Stock assume).

The task vector of task t is τ_t = θ̂_t − start_t (the task's own update; = θ̂_t − θ_0 under
`base`, the papers' definition). Each method's `deploy` maps θ̂_t (and its state) to θ_t.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cvl.errors import CvlError
from cvl.methods import merge_ops
from cvl.methods.base import TaskContext, Wrapper
from cvl.models.tune import assign_, effective_state, merge_adapters, trained_names
from cvl.train.fsdp import is_dtensor

Weights = dict[str, torch.Tensor]
INITS = ("merged", "finetuned", "base")


def floating_state(model: nn.Module) -> Weights:
    """The model's floating weights and buffers by plain name, restricted to what `--tune`
    trains; live tensors (detached) for a plain model, the effective (computed) ones for an
    adapted weight. Read-only: change them with `write_` / `interpolate_`."""
    keep = trained_names(model)
    return {
        k: v
        for k, v in effective_state(model).items()
        if v.is_floating_point() and (keep is None or k in keep)
    }


def statistics_names(model: nn.Module) -> frozenset[str]:
    """Plain names of the weights (`floating_state`) that are buffers, not parameters: the
    data statistics a model keeps (BatchNorm's running mean / variance), merged apart by the
    task-vector merges (module doc)."""
    buffers = {n for n, b in model.named_buffers() if b.is_floating_point()}
    return frozenset(buffers & set(floating_state(model)))


def clone_weights(w: Weights, device: torch.device | str | None = None) -> Weights:
    """Independent copies (optionally moved), for state that must not follow the model; a
    sharded tensor (`--fsdp`) stays where its shard is (1/N of it per process)."""
    return {
        k: v.detach().clone() if is_dtensor(v) else v.detach().to(device or v.device, copy=True)
        for k, v in w.items()
    }


@torch.no_grad()
def write_(model: nn.Module, weights: Weights) -> None:
    """model ← `weights` (plain names; the tensors not named keep their values)."""
    merge_adapters(model)
    live = floating_state(model)
    bad = sorted(set(weights) - set(live))
    if bad:
        raise CvlError(f"weights to write do not match the model ({', '.join(bad[:3])}, ...)")
    assign_(model, {k: v.to(live[k].device, live[k].dtype) for k, v in weights.items()})


@torch.no_grad()
def interpolate_(model: nn.Module, other: nn.Module | Weights, alpha: float) -> None:
    """model ← α·model + (1 − α)·other, in place (the weights `floating_state` names)."""
    theirs = other if isinstance(other, dict) else floating_state(other)
    write_(model, interpolation((alpha, 1.0 - alpha))([floating_state(model), theirs]))


# -- merge operators -----------------------------------------------------------------------------
MergeOperator = Callable[[Sequence[Weights], "Weights | None"], Weights]


def interpolation(coefficients: Sequence[float] | None = None) -> MergeOperator:
    """Σ_i c_i·θ_i by name, on the first model's device and dtype; c_i = 1/n unless given
    (FoMo-in-Flux `continual_lib/merge.py`, `Interpolation.merge` with `weight_coefficients`
    null: the arithmetic mean, ½/½ for two models). The initial weights are not used."""

    def merge(models: Sequence[Weights], initial: Weights | None = None) -> Weights:
        c = list(coefficients) if coefficients is not None else [1.0 / len(models)] * len(models)
        if len(c) != len(models) or abs(sum(c) - 1.0) > 1e-6:
            raise CvlError(f"interpolation: {len(c)} coefficients summing to 1 expected, got {c}")
        first = models[0]
        out = {}
        for k, v in first.items():
            acc = v * c[0]
            for ci, m in zip(c[1:], models[1:]):
                acc = acc + m[k].to(v.device, v.dtype) * ci
            out[k] = acc
        return out

    return merge


def slerp(coefficients: Sequence[float] = (0.5, 0.5)) -> MergeOperator:
    """Per tensor, the spherical interpolation of two models with weight c_0 on the first
    (`merge_ops.slerp`; FoMo-in-Flux `SLERP`, default ½/½)."""

    def merge(models: Sequence[Weights], initial: Weights | None = None) -> Weights:
        if len(models) != 2 or len(coefficients) != 2 or abs(sum(coefficients) - 1) > 1e-6:
            raise CvlError("slerp: two models and two coefficients summing to 1 expected")
        new, old = models
        return {k: merge_ops.slerp(v, old[k].to(v.device), coefficients[0]) for k, v in new.items()}

    return merge


def task_vector_operator(combine: Callable[[list[Weights]], Weights], lam: float) -> MergeOperator:
    """θ_0 + λ·combine([θ_i − θ_0]): the shape of FoMo-in-Flux's task-vector merges."""

    def merge(models: Sequence[Weights], initial: Weights | None = None) -> Weights:
        if initial is None:
            raise CvlError("a task-vector merge needs the initial weights")
        taus = [{k: m[k].to(v.device) - v for k, v in initial.items()} for m in models]
        return add_scaled(initial, combine(taus), lam)

    return merge


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


#: name → factory(**its arguments) of a merge operator (module doc)
OPERATORS: dict[str, Callable[..., MergeOperator]] = {
    "interpolation": interpolation,
    "slerp": slerp,
    "task_arithmetic": lambda lam=1.0: task_vector_operator(lambda t: sum_weights(t), lam),
    # the models come newest first: magmax folds them oldest first (a tie goes to the newer
    # task, as the `magmax` method and its code), dare seeds model i by its task index n−1−i
    # (as the `dare` method: seed + task index), so both equal their methods' merges
    "magmax": lambda lam=0.5: task_vector_operator(lambda t: merge_ops.max_abs(t[::-1]), lam),
    "dare": lambda p=0.5, lam=0.3, seed=0: task_vector_operator(
        lambda t: sum_weights(
            [merge_ops.dare(x, p, _seeded(seed + len(t) - 1 - i)) for i, x in enumerate(t)]
        ),
        lam,
    ),
    "breadcrumbs": lambda keep=0.2, remove=0.1, lam=0.4: task_vector_operator(
        lambda t: sum_weights([merge_ops.breadcrumbs(x, keep, remove) for x in t]), lam
    ),
    "tall_masks": lambda tall_lambda=0.4, k=2, lam=1.0: task_vector_operator(
        lambda t: merge_ops.consensus(t, tall_lambda, k), lam
    ),
}


def merge_operator(name: str, **args: Any) -> MergeOperator:
    """The operator `name` built with its arguments (one-line error for an unknown name)."""
    if name not in OPERATORS:
        raise CvlError(f"unknown merge operator {name!r} (choices: {', '.join(OPERATORS)})")
    return OPERATORS[name](**args)


def sum_weights(ws: Sequence[Weights]) -> Weights:
    """Σ_i w_i by name (on the first one's device)."""
    out = dict(ws[0])
    for w in ws[1:]:
        out = {k: v + w[k].to(v.device) for k, v in out.items()}
    return out


def add_scaled(initial: Weights, tau: Weights, scale: float | dict[str, float]) -> Weights:
    """θ_0 + s·τ by name, s one number or one per name (LiNeS)."""
    out = {}
    for k, v in initial.items():
        s = scale[k] if isinstance(scale, dict) else scale
        out[k] = v + s * tau[k].to(v.device, v.dtype)
    return out


def load_initial(ctx: TaskContext) -> Weights:
    """θ_0: the run's initial weights (`RUN/init/`), as `floating_state` names them."""
    from cvl.methods.base import frozen_copy
    from cvl.models import load_weights
    from cvl.runs import MODEL_FILE

    m = frozen_copy(ctx.model)
    load_weights(m, Path(ctx.run_dir) / "init" / MODEL_FILE)
    return clone_weights(floating_state(m))


class MergeMethod(Wrapper):
    """Base of the merges: runs a base method (`base=NAME`), then deploys a merge of weights.

    Subclasses set `defaults` (with `init` when it is a choice, else class attribute `init`)
    and implement `deploy(ctx, tuned) -> Weights` (θ_t from θ̂_t = `tuned`), using
    `self.start` (start_t), `self.initial(ctx)` (θ_0) and, when `keeps_previous` is set,
    `self.previous` (the deployed θ_{t−1}, θ_0 for t = 0, read before `init` replaces it);
    `merge_first_task` = False keeps θ̂_0 on the first task. State that must survive a task
    (θ̂_{t−1}, running sums) goes in `own_state` / `load_own_state` (tensors on the CPU).
    """

    init = "merged"
    merge_first_task = True
    keeps_previous = False
    #: "merged": the statistics (`statistics_names`) go through `deploy` with the weights;
    #: "mean": `deploy` sees the weights only and the statistics deployed are the mean of the
    #: task models' (module doc)
    statistics = "merged"

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.init = self.args.get("init", type(self).init)
        if self.init not in INITS:
            raise CvlError(
                f"method '{self.name}': init must be {' or '.join(INITS)} (got {self.init!r})"
            )
        self.start: Weights | None = None
        self.finetuned: Weights | None = None  # θ̂_{t−1} (init=finetuned)
        self.previous: Weights | None = None  # θ_{t−1} during a task (keeps_previous)
        self._initial: Weights | None = None
        self.stat_sum: Weights = {}  # Σ of the task models' statistics (statistics="mean")
        self.stat_count = 0

    def initial(self, ctx: TaskContext) -> Weights:
        """θ_0 as `deploy` sees it (loaded once, on the model's device): without the
        statistics under statistics="mean"."""
        full = self.initial_state(ctx)
        if self.statistics != "mean":
            return full
        stats = statistics_names(ctx.model)
        return {k: v for k, v in full.items() if k not in stats}

    def initial_state(self, ctx: TaskContext) -> Weights:
        """θ_0 whole, statistics included (what a task trains from under init=base)."""
        if self._initial is None:
            self._initial = load_initial(ctx)
        return self._initial

    def before_task(self, ctx: TaskContext) -> None:
        if self.keeps_previous:  # the model holds θ_{t−1} here, also on resume; a probe's
            # rerun (cvl.train.budget) restores it from the method state instead
            self.previous = clone_weights(floating_state(ctx.model), "cpu")
        if self.init == "finetuned" and self.finetuned is not None:
            write_(ctx.model, self.finetuned)
        elif self.init == "base" and not ctx.first_task:
            write_(ctx.model, self.initial_state(ctx))
        self.start = clone_weights(floating_state(ctx.model))  # also on resume (before last/)
        super().before_task(ctx)

    def after_task(self, ctx: TaskContext) -> None:
        super().after_task(ctx)  # the base method's own end of task (e.g. EWC's Fisher)
        tuned = clone_weights(floating_state(ctx.model))
        if ctx.first_task and not self.merge_first_task:
            self.record(ctx, tuned)
        elif self.statistics == "mean":
            write_(ctx.model, self.deploy_apart(ctx, tuned))
        else:
            write_(ctx.model, self.deploy(ctx, tuned))
        if self.init == "finetuned":
            self.finetuned = clone_weights(tuned, "cpu")
        self.start = self.previous = None

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        raise NotImplementedError

    @torch.no_grad()
    def deploy_apart(self, ctx: TaskContext, tuned: Weights) -> Weights:
        """`deploy` of the weights without the statistics, then the statistics as the mean of
        the task models' so far (statistics="mean"; the sum kept in float64 on the CPU)."""
        stats = statistics_names(ctx.model)
        for k in stats:
            v = tuned[k].detach().to("cpu", torch.float64)
            self.stat_sum[k] = self.stat_sum[k] + v if k in self.stat_sum else v
        self.stat_count += 1
        deployed = self.deploy(ctx, {k: v for k, v in tuned.items() if k not in stats})
        mean = {k: (self.stat_sum[k] / self.stat_count).to(tuned[k].dtype) for k in stats}
        return {**deployed, **mean}

    def record(self, ctx: TaskContext, tuned: Weights) -> None:
        """What a method keeps of a task it does not merge (`merge_first_task` False)."""

    def own_state(self) -> dict[str, Any]:
        st = self.merge_state()
        if self.finetuned is not None:
            st["finetuned"] = dict(self.finetuned)
        if self.previous is not None:
            st["previous"] = dict(self.previous)
        if self.stat_count:
            st["statistics_sum"] = dict(self.stat_sum)
            st["statistics_count"] = self.stat_count
        return st

    def load_own_state(self, state: dict[str, Any]) -> None:
        if "finetuned" in state:
            self.finetuned = dict(state["finetuned"])
        if "previous" in state:
            self.previous = dict(state["previous"])
        if "statistics_count" in state:
            self.stat_sum = dict(state["statistics_sum"])
            self.stat_count = int(state["statistics_count"])
        self.load_merge_state(state)

    def merge_state(self) -> dict[str, Any]:
        return {}

    def load_merge_state(self, state: dict[str, Any]) -> None:
        pass

    def task_vector(self, tuned: Weights) -> Weights:
        """τ_t = θ̂_t − start_t."""
        return {k: v - self.start[k] for k, v in tuned.items()}


#: LiNeS's arguments, taken by every task-vector merge (FoMo-in-Flux `lines_params` default
#: (0.5, 0.5, ·, "linear"))
LINES = {"lines": False, "lines_alpha": 0.5, "lines_beta": 0.5}


class TaskVectorMerge(MergeMethod):
    """A merge deploying θ_t = θ_0 + λ·τ_m (τ_m its merge of task vectors), with `lines=true`
    the LiNeS scales α + β·ℓ/(L − 1) per tensor in place of λ (`merge_ops.lines_scales`;
    FoMo-in-Flux's `TaskArithmetic`/`TIES.merge`: `zs_vector + lw * merged_task_vectors`).
    Subclasses set `lam_key` (their λ argument) and put `LINES` in their defaults."""

    lam_key = "lam"
    statistics = "mean"

    def apply(self, initial: Weights, tau: Weights) -> Weights:
        """θ_0 + λ·τ, or θ_0 + LiNeS(τ) under `lines=true`."""
        if self.args.get("lines"):
            scale: float | dict[str, float] = merge_ops.lines_scales(
                initial, self.args["lines_alpha"], self.args["lines_beta"]
            )
        else:
            scale = self.args[self.lam_key]
        return add_scaled(initial, tau, scale)


ANCHORS = ("previous", "initial", "start")


class InterpolationMerge(MergeMethod):
    """One interpolation per task end: θ_t = α·θ̂_t + (1 − α)·anchor_t (the `interpolation`
    operator on [θ̂_t, anchor_t], coefficients [α, 1 − α]).

    `anchor`: `previous` = the deployed θ_{t−1} (θ_0 for t = 0), so θ_t is a running merge of
    all task models, FoMo-in-Flux's "unrolled" merge (`continual_lib/ema_paint.py`,
    `zs_paint.py`: `Model.unrolled_merge` folds f_merge([θ̂_i, running]) over the stored
    checkpoints [θ_0, θ̂_0, ..., θ̂_t]); `initial` = θ_0 (`ft_paint.py`: f_merge([θ̂_t, θ_0]));
    `start` = start_t, the weights the task trained from (= `previous` under init=merged, =
    `initial` under init=base, θ̂_{t−1} under init=finetuned: consecutive fine-tuned models).
    `first_task`: merge task 0 too (FoMo-in-Flux does: its list of checkpoints starts with θ_0)
    or keep θ̂_0. The registered names (`wise`, `ema_merge`, `zs_merge`, `ft_merge`,
    `best_in_time`, `slerp`) are this class with their own defaults; `operator` is the pair
    operator (`interpolation`, or `slerp` for the `slerp` method).
    """

    operator = "interpolation"

    defaults = {
        "base": "seqft",
        "alpha": 0.5,
        "anchor": "previous",
        "init": "merged",
        "first_task": True,
    }

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        if not 0.0 <= self.args["alpha"] <= 1.0:
            raise CvlError(
                f"method '{self.name}': alpha must be in [0, 1] (got {self.args['alpha']})"
            )
        self.check_choice("anchor", ANCHORS)
        self.merge_first_task = bool(self.args["first_task"])
        # under init=merged θ_{t−1} is start_t, already kept
        self.keeps_previous = self.args["anchor"] == "previous" and self.init != "merged"

    def anchor(self, ctx: TaskContext) -> Weights:
        """The weights θ̂_t is merged with (class doc)."""
        a = self.args["anchor"]
        if a == "initial":
            return self.initial(ctx)
        if a == "previous" and self.keeps_previous:
            return self.previous
        return self.start

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        alpha = self.args["alpha"]
        merge = merge_operator(self.operator, coefficients=(alpha, 1.0 - alpha))
        return merge([tuned, self.anchor(ctx)], None)  # a pair operator needs no θ_0
