"""TIES-Merging (Yadav et al., NeurIPS 2023, "Resolving interference when merging models"):
the task vectors τ_i = θ̂_i − start_i are merged in three steps, and θ_t = θ_0 + λ·τ_m:

1. **Trim**: each τ_i keeps its top-k entries by magnitude (k = `k` = 20 %), the others
   become 0; as the authors' code `topk_values_mask`: over all d entries of the vector at
   once, keeping every |x| ≥ the (d − ⌊d·k⌋)-th smallest |x| (⌊d·k⌋ + 1 entries if no ties);
2. **Elect**: the sign of each entry is the sign of the sum of the trimmed vectors ("mass");
   entries whose sum is 0 take the majority sign (the sign of the sum of the elected signs,
   the code's `resolve_zero_signs`);
3. **Disjoint mean**: τ_m = mean of the trimmed entries that agree with the elected sign
   (entries with no agreeing vector stay 0).

λ = `lam` = 1 and the rest are the authors' code's example (prateeky2806/ties-merging,
`ties_minimal.ipynb`: K = 20, elect "mass", "dis-mean", lamda = 1; the paper tunes λ on
validation data). In the stream: with `init=base` (default) every task trains from θ_0 and after task t the vectors of tasks 0..t
are merged; the trimmed vectors are kept (t + 1 copies of the trained weights, CPU in the
checkpoint: memory grows with the stream). Wraps a base method (`base=NAME`, default seqft),
see `cvl.methods.merging`. `lines=true` scales τ_m per layer by LiNeS in place of λ.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.errors import CvlError
from cvl.methods.base import TaskContext
from cvl.methods.merge_dist import global_kthvalue
from cvl.methods.merging import LINES, TaskVectorMerge, Weights, clone_weights
from cvl.methods.registry import register
from cvl.train.fsdp import is_dtensor, plain


@torch.no_grad()
def trim_top_k(tau: Weights, k: float) -> Weights:
    """τ with all but its top-k fraction of entries (by |value|, over all tensors) set to 0."""
    if k >= 1.0:
        return dict(tau)
    d = sum(v.numel() for v in tau.values())
    kk = max(1, d - int(d * k))  # the code's k = d − int(d·K)
    if any(is_dtensor(v) for v in tau.values()):  # --fsdp: the same threshold, from shards
        kth = global_kthvalue([v.detach().abs() for v in tau.values()], kk)
    else:
        # in the vectors' own dtype (torch.cat promotes mixed ones), as the code's kthvalue:
        # a cast would merge distinct magnitudes (float64 → float32) and move the threshold
        flat = torch.cat([v.detach().abs().flatten().cpu() for v in tau.values()])
        kth = flat.kthvalue(kk).values
    return {n: v * (v.abs() >= kth.to(v.device)) for n, v in tau.items()}


@torch.no_grad()
def ties_merge(trimmed: list[Weights], agg: str = "mean") -> Weights:
    """Elect signs by mass, then the disjoint mean (`agg="sum"`: sum) of the agreeing entries
    (TIES steps 2–3; the code's `disjoint_merge` with merge_func dis-mean / dis-sum)."""
    names = list(trimmed[0])
    total = {n: sum(t[n] for t in trimmed) for n in names}
    elected = {n: torch.sign(total[n]) for n in names}
    majority = torch.sign(sum(plain(e.sum()) for e in elected.values()))  # (sharded: summed)
    out = {}
    for n in names:
        sign = torch.where(elected[n] == 0, majority, elected[n])
        stack = torch.stack([t[n] for t in trimmed])
        keep = torch.where(sign > 0, stack > 0, stack < 0)
        picked = stack * keep
        if agg == "sum":
            out[n] = picked.sum(0)
        else:
            out[n] = picked.sum(0) / keep.sum(0).clamp(min=1).to(picked.dtype)
    return out


@register("ties")
class TIES(TaskVectorMerge):
    """TIES-Merging: trim top 20 %, elect signs by mass, disjoint mean; θ_0 + λ·τ_m (λ = 1)."""

    defaults = {"base": "seqft", "k": 0.2, "lam": 1.0, "init": "base", **LINES}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        if not 0.0 < self.args["k"] <= 1.0:
            raise CvlError(f"method '{self.name}': k must be in (0, 1] (got {self.args['k']})")
        self.trimmed: list[Weights] = []

    def vector(self, ctx: TaskContext, tuned: Weights) -> Weights:
        """The task's vector before trimming (`dare_ties`: dropped and rescaled)."""
        return self.task_vector(tuned)

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        self.trimmed.append(
            clone_weights(trim_top_k(self.vector(ctx, tuned), self.args["k"]), "cpu")
        )
        initial = self.initial(ctx)
        dev = next(iter(initial.values())).device
        agg = self.args.get("agg", "mean")
        merged = ties_merge([clone_weights(t, dev) for t in self.trimmed], agg)
        return self.apply(initial, merged)

    def merge_state(self) -> dict[str, Any]:
        return {"trimmed": [dict(t) for t in self.trimmed]} if self.trimmed else {}

    def load_merge_state(self, state: dict[str, Any]) -> None:
        if "trimmed" in state:
            self.trimmed = [dict(t) for t in state["trimmed"]]
