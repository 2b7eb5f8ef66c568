"""MagMax (Marczak et al., ECCV 2024, "MagMax: leveraging model merging for seamless continual
learning"): sequential fine-tuning, and the deployed model takes, per parameter, the task
vector entry of largest magnitude among the tasks seen so far,

    τ_i = θ̂_i − θ_0,   τ_max[j] = τ_{argmax_i |τ_i[j]|}[j],   θ_t = θ_0 + λ·τ_max.

Source: danielm1405/magmax. Task vectors are taken against the pre-trained weights
(`src/merging/task_vectors.py`, `TaskVector.__init__`: finetuned − pretrained) of the models of
sequential fine-tuning (`finetune_splitted.py --sequential_finetuning`: task t trains from
θ̂_{t−1}; here `init=finetuned`, the default: the deployed θ_t is evaluated, training follows
θ̂); `merge_max_abs` folds `torch.where(|τ_i| >= |max|, τ_i, max)` over them in task order (a
tie goes to the later task); λ = `lam` = 0.5 is its scripts' value (`merge_splitted.py`,
`merge_8datasets.py`: `(merge_max_abs, [0.5])`; FusionBench `config/method/magmax/magmax.yaml`
the same). After task t the max is over tasks 0..t (as `evaluate_merged_fts` merges
`task_vectors[:idx+1]`); since the fold is associative only the running τ_max is kept (one copy
of the trained weights, CPU in the checkpoint). The code merges every float tensor of the
state dict; here those `--tune` trains (`cvl.methods.merging`). `lines=true` applies LiNeS in
place of λ (not in MagMax's code; FoMo-in-Flux's `MagMax` ignores its lines arguments).
Wraps a base method (`base=NAME`, default seqft).
"""

from __future__ import annotations

from typing import Any

from cvl.methods.base import TaskContext
from cvl.methods.merge_ops import max_abs
from cvl.methods.merging import LINES, TaskVectorMerge, Weights, clone_weights
from cvl.methods.registry import register


@register("magmax")
class MagMax(TaskVectorMerge):
    """MagMax: sequential fine-tuning; θ_t = θ_0 + λ·(max-magnitude entry of τ_0..τ_t), λ = 0.5."""

    defaults = {"base": "seqft", "lam": 0.5, "init": "finetuned", **LINES}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.tau_max: Weights | None = None

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        initial = self.initial(ctx)
        tau = {k: v - initial[k] for k, v in tuned.items()}  # against θ_0, not start_t
        if self.tau_max is not None:  # the earlier max first: a tie goes to the new task
            dev = next(iter(tau.values())).device
            tau = max_abs([clone_weights(self.tau_max, dev), tau])
        self.tau_max = tau
        return self.apply(initial, self.tau_max)

    def merge_state(self) -> dict[str, Any]:
        return {"tau_max": dict(self.tau_max)} if self.tau_max is not None else {}

    def load_merge_state(self, state: dict[str, Any]) -> None:
        if "tau_max" in state:
            self.tau_max = clone_weights(state["tau_max"])
