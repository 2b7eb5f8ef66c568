"""OPCM (Tang et al., NeurIPS 2025, "Merging models on the fly without retraining: a sequential
approach to scalable continual model merging"): every task model is fine-tuned from θ_0
(`init=base`), and the merged model is updated once per task: the new task vector, in each
linear layer projected away from the previous merged vector's leading singular directions, is
added to the running sum, and the sum is rescaled to the average task-vector norm,

    t = 0:   τ̄_0 = τ_0 = θ̂_0 − θ_0,  λ_0 = 1,  θ_0' = θ̂_0;
    t > 0:   S_t = λ_{t−1}·τ̄_{t−1} + P(τ̄_{t−1}, τ_t)   (P = projection per linear weight,
                                                          identity for the other tensors),
             n̄_t = mean_{i≤t} ‖τ_i‖,   λ_t = ‖S_t‖ / n̄_t,   τ̄_t = S_t / λ_t,   θ_t = θ_0 + τ̄_t,

with, for a linear weight, U, s, V the SVD of τ̄_{t−1} (full matrices), r the first index where
cumsum(s)/Σs > α, and P(τ̄, τ) = U·Q·Vᵀ, Q = Uᵀ·τ·V with its diagonal and its top-left r × r block
zeroed (`merge_ops.opcm_project`). α = `alpha` = 0.5.

Source: tanganke/fusion_bench, `fusion_bench/method/opcm/opcm.py`, `OPCMForCLIP.run`,
`merge_linear_weights`, `merge_other_parameters` (norms by `utils.get_task_vector_norm`, over
the whole state dict); `config/method/opcm/opcm.yaml` (alpha 0.5). Its model order is shuffled
(`shuffle_order: true`); here it is the stream's task order.

Where FusionBench's code is specific to HF CLIP or silent: "linear weights" are the weights of
the model's `nn.Linear` modules (as its `isinstance(module, nn.Linear)`), and open_clip's fused
attention input projection `in_proj_weight` ([3d, d], the q, k, v projections HF CLIP holds as
three `nn.Linear`) is projected as its three d × d blocks; every other floating tensor that
`--tune` trains (embeddings, norms, biases, under `--tune lora` the adapted weights as they
compute) is summed as `merge_other_parameters` does, and the final rescale
touches every merged tensor (FusionBench rescales `named_parameters` only and skips the direct
parameters of non-leaf modules such as HF CLIP's class embedding; cvl merges all of them alike).
BatchNorm statistics are not task-vector entries (nor in the norms): the mean of the task
models' is deployed (`cvl.methods.merging`, "Statistics"; HF CLIP has none).
The norms are in float64 here. The state kept: τ̄_{t−1}, λ_{t−1} and the task-vector norms (one
copy of the trained weights, CPU in the checkpoint). Wraps a base method (`base=NAME`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cvl.errors import CvlError
from cvl.methods.base import TaskContext
from cvl.methods.merge_dist import whole
from cvl.methods.merge_ops import opcm_project, vector_norm
from cvl.methods.merging import MergeMethod, Weights, clone_weights
from cvl.methods.registry import register


def linear_weights(model: nn.Module) -> dict[str, int]:
    """Plain name → number of stacked linear maps (1, or 3 for a fused q/k/v projection)."""
    out: dict[str, int] = {}
    for name, m in model.named_modules():
        pre = f"{name}." if name else ""
        if isinstance(m, nn.Linear):
            out[pre + "weight"] = 1
        elif isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None:
            out[pre + "in_proj_weight"] = 3
    return out


@torch.no_grad()
def opcm_step(
    previous: Weights, tau: Weights, prev_lambda: float, alpha: float, linear: dict[str, int]
) -> Weights:
    """S = λ_{t−1}·τ̄_{t−1} + P(τ̄_{t−1}, τ_t) per tensor (module doc)."""
    out = {}
    for k, t in tau.items():
        prev = previous[k].to(t.device, t.dtype)
        chunks = linear.get(k, 0) if t.dim() == 2 else 0
        if chunks:

            def project(prev: torch.Tensor, t: torch.Tensor, n: int = chunks) -> torch.Tensor:
                parts = zip(prev.chunk(n, 0), t.chunk(n, 0))
                return torch.cat([opcm_project(p, x, alpha) for p, x in parts], 0)

            cleaned = whole(project, prev, t)  # --fsdp: the SVD of the whole matrix
        else:
            cleaned = t
        out[k] = prev_lambda * prev + cleaned
    return out


@register("opcm")
class OPCM(MergeMethod):
    """OPCM: each task vector projected off the merged vector's top singular subspace, added, rescaled."""

    defaults = {"base": "seqft", "alpha": 0.5, "init": "base"}
    statistics = "mean"  # merging.py: statistics

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        if not 0.0 <= self.args["alpha"] <= 1.0:
            raise CvlError(f"method 'opcm': alpha must be in [0, 1] (got {self.args['alpha']})")
        self.merged: Weights | None = None  # τ̄_{t−1}
        self.prev_lambda = 1.0
        self.norms: list[float] = []

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        initial = self.initial(ctx)
        tau = {k: v - initial[k] for k, v in tuned.items()}
        self.norms.append(float(vector_norm(tau)))
        if self.merged is None:
            merged, self.prev_lambda = tau, 1.0
        else:
            s = opcm_step(self.merged, tau, self.prev_lambda, self.args["alpha"], self._linear(ctx))
            avg = sum(self.norms) / len(self.norms)
            lam = float(vector_norm(s)) / avg
            merged = {k: v / lam for k, v in s.items()}
            self.prev_lambda = lam
        self.merged = clone_weights(merged)
        return {k: v + merged[k].to(v.device, v.dtype) for k, v in initial.items()}

    @staticmethod
    def _linear(ctx: TaskContext) -> dict[str, int]:
        return linear_weights(ctx.model)

    def merge_state(self) -> dict[str, Any]:
        if self.merged is None:
            return {}
        return {
            "merged": dict(self.merged),
            "prev_lambda": self.prev_lambda,  # floats round-trip exactly through JSON
            "norms": list(self.norms),
        }

    def load_merge_state(self, state: dict[str, Any]) -> None:
        if "merged" in state:
            self.merged = clone_weights(state["merged"])
            self.prev_lambda = float(state["prev_lambda"])
            self.norms = [float(x) for x in state["norms"]]
