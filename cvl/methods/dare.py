"""DARE (Yu et al., ICML 2024, "Language models are super Mario: absorbing abilities from
homologous models as a free lunch"): Drop And REscale each task vector before merging,

    τ̃_i = τ_i ⊙ m_i / (1 − p),   m_i[j] = [u_ij > p],  u_ij ~ U[0, 1),

then `dare`: task arithmetic of the τ̃_i, θ_t = θ_0 + λ·Σ_{i≤t} τ̃_i; `dare_ties`: TIES of the
τ̃_i (trim to the top k by magnitude, elect signs by mass, merge the agreeing entries),
θ_t = θ_0 + λ·τ_m.

Source: tanganke/fusion_bench, `fusion_bench/method/dare/` (`utils.py`, `param_random_drop_`:
`torch.rand_like(param) > sparsity_level`, rescale `/ (1 - sparsity_level)`; `task_arithmetic.py`,
`DareTaskArithmetic.run`; `ties_merging.py`, `DareTiesMerging.run`: drop, then
`ties_merging(reset_thresh=threshold, merge_func)`) with its configs' defaults
(`config/method/dare/task_arithmetic.yaml`: p = 0.5, λ = 0.3; `ties_merging.yaml`: p = 0.5,
λ = 0.5, threshold 20 (top 20 %), merge_func `sum`), every tensor dropped
(`only_on_linear_weights: false`; FusionBench drops `parameters()`, cvl every weight it
merges; BatchNorm statistics are no task-vector entries: `cvl.methods.merging`, "Statistics"),
rescaled. TIES's trim is cvl's `ties.trim_top_k` (the TIES authors' `topk_values_mask`, over
the whole vector), its election and `sum`/`mean` aggregation
`ties.ties_merge` (`agg`). FoMo-in-Flux's `DARETIES` differs (its random mask keeps the entries
whose draw is ≥ the ⌊d·p⌋-th smallest draw over the flattened vector, and it drops *instead of*
trimming, p = 0.2, disjoint mean); FusionBench's is followed here.

Where the code is silent: the draws. Each task's mask is drawn once, when the task ends, on a
CPU generator seeded with `seed` + the task index (one U[0, 1) float32 draw per entry, tensors in
name order), so it does not depend on the device, the global RNG or a resume. In the stream,
`init=base` (default): every task trains from θ_0; `dare` keeps the running Σ τ̃_i, `dare_ties`
every τ̃_i (memory grows with the stream, as `ties`). `lines=true` applies LiNeS in place of λ.
Wraps a base method (`base=NAME`, default seqft).
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.errors import CvlError
from cvl.methods.base import TaskContext
from cvl.methods.merge_ops import dare
from cvl.methods.merging import LINES, TaskVectorMerge, Weights
from cvl.methods.registry import register
from cvl.methods.task_arith import TaskArithmetic
from cvl.methods.ties import TIES


def check_p(method: TaskVectorMerge) -> None:
    """A clear error unless 0 ≤ p < 1."""
    if not 0.0 <= method.args["p"] < 1.0:
        raise CvlError(f"method '{method.name}': p must be in [0, 1) (got {method.args['p']})")


def dropped(method: TaskVectorMerge, ctx: TaskContext, tuned: Weights) -> Weights:
    """The task's vector dropped and rescaled, its mask drawn from seed + the task index."""
    gen = torch.Generator().manual_seed(int(method.args["seed"]) + int(ctx.task_index))
    return dare(method.task_vector(tuned), method.args["p"], gen)


@register("dare")
class Dare(TaskArithmetic):
    """DARE + task arithmetic: drop p = 0.5 of each task vector, rescale 1/(1−p); θ_0 + 0.3·Σ."""

    defaults = {"base": "seqft", "p": 0.5, "lam": 0.3, "seed": 0, "init": "base", **LINES}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        check_p(self)

    def vector(self, ctx: TaskContext, tuned: Weights) -> Weights:
        return dropped(self, ctx, tuned)


@register("dare_ties")
class DareTies(TIES):
    """DARE + TIES: drop p = 0.5 and rescale, trim to the top 20 %, elect signs, sum; θ_0 + 0.5·τ_m."""

    defaults = {
        "base": "seqft",
        "p": 0.5,
        "k": 0.2,
        "agg": "sum",
        "lam": 0.5,
        "seed": 0,
        "init": "base",
        **LINES,
    }

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        check_p(self)
        self.check_choice("agg", ("sum", "mean"))

    def vector(self, ctx: TaskContext, tuned: Weights) -> Weights:
        return dropped(self, ctx, tuned)
