"""Model Stock (Jang et al., ECCV 2024, "Model Stock: all we need is just a few fine-tuned
models"): per weight tensor ("layer-wise"), the average of k fine-tuned weights is pulled
towards the pre-trained anchor θ_0 by the ratio

    t = k·cos θ / ((k − 1)·cos θ + 1),      θ_H = t·w_avg + (1 − t)·θ_0 = θ_0 + t·mean(τ_i),

where θ is the angle between the fine-tuned weights' offsets from θ_0 (τ_i = w_i − θ_0; the
paper merges k = 2 models fine-tuned from θ_0). In the stream, with
`init=base` (default) every task trains from θ_0, so after task t the fine-tuned models are
the k = t + 1 task models θ̂_0..θ̂_t and cos θ is the mean cosine over all pairs of their task
vectors (the paper's equal-angle assumption for k > 2; mergekit averages consecutive pairs
row-wise instead). cos θ is clipped to [0, 1] so that t ∈ [0, 1]; a zero task vector counts
as cosine 0 with the others; k = 1 deploys θ̂_0 (t = 1). Only Σ τ_i and Σ τ_i/‖τ_i‖ per tensor
are kept (the pairwise cosines follow from them: Σ_{i≠j} cos_ij = ‖Σ u_i‖² − Σ‖u_i‖²).
The authors' code is not public (naver-ai/model-stock holds a README). Wraps a base method
(`base=NAME`, default seqft), see `cvl.methods.merging`.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.methods.base import TaskContext
from cvl.methods.merging import MergeMethod, Weights, clone_weights
from cvl.methods.registry import register
from cvl.train.fsdp import plain


def stock_ratio(cos: torch.Tensor, k: int) -> torch.Tensor:
    """t = k·cos / ((k − 1)·cos + 1), cos clipped to [0, 1]."""
    c = cos.clamp(0.0, 1.0)
    return k * c / ((k - 1) * c + 1)


@torch.no_grad()
def mean_pairwise_cos(unit_sum: torch.Tensor, unit_sq: torch.Tensor, k: int) -> torch.Tensor:
    """Mean over the k(k−1) ordered pairs of u_i·u_j, from Σ u_i and Σ ‖u_i‖²."""
    if k < 2:
        return torch.ones((), dtype=unit_sum.dtype, device=unit_sum.device)
    return (plain(unit_sum.pow(2).sum()) - unit_sq) / (k * (k - 1))


@register("model_stock")
class ModelStock(MergeMethod):
    """Model Stock: θ_0 + t·mean(τ_i), t = k·cos/((k−1)·cos+1) per tensor (Jang et al. 2024)."""

    defaults = {"base": "seqft", "init": "base"}
    statistics = "mean"  # merging.py: statistics

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.k = 0
        self.tau_sum: Weights = {}
        self.unit_sum: Weights = {}
        self.unit_sq: Weights = {}

    @torch.no_grad()
    def add(self, tau: Weights) -> None:
        """One more fine-tuned model's task vector into the running sums."""
        for n, v in tau.items():
            v = v.float()
            norm = plain(v.norm())  # --fsdp: of the whole tensor (`plain` reduces the shards')
            u = v / norm if norm > 0 else torch.zeros_like(v)
            sq = plain((u * u).sum())
            if self.k == 0:
                self.tau_sum[n], self.unit_sum[n], self.unit_sq[n] = v, u, sq
            else:
                self.tau_sum[n] = self.tau_sum[n].to(v.device) + v
                self.unit_sum[n] = self.unit_sum[n].to(v.device) + u
                self.unit_sq[n] = self.unit_sq[n].to(v.device) + sq
        self.k += 1

    @torch.no_grad()
    def merged(self, initial: Weights) -> Weights:
        out = {}
        for n, w0 in initial.items():
            cos = mean_pairwise_cos(self.unit_sum[n], self.unit_sq[n], self.k)
            t = stock_ratio(cos, self.k)
            out[n] = w0 + (t * self.tau_sum[n].to(w0.device) / self.k).to(w0.dtype)
        return out

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        self.add(self.task_vector(tuned))
        return self.merged(self.initial(ctx))

    def merge_state(self) -> dict[str, Any]:
        if not self.k:
            return {}
        return {
            "k": self.k,
            "tau_sum": dict(self.tau_sum),
            "unit_sum": dict(self.unit_sum),
            "unit_sq": dict(self.unit_sq),
        }

    def load_merge_state(self, state: dict[str, Any]) -> None:
        if "k" in state:
            self.k = int(state["k"])
            for key in ("tau_sum", "unit_sum", "unit_sq"):
                setattr(self, key, clone_weights(state[key]))
