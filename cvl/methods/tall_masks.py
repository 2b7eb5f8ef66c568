"""TALL masks / Consensus merging (Wang et al., ICML 2024, "Localizing task information for
improved model merging and compression"), as FoMo-in-Flux deploys it in a stream: every task
trains from θ_0, and with τ_MTL = Σ_{i≤t} τ_i the per-task masks and the deployed model are

    m_i = [ |τ_i| > λ_m·|τ_MTL − τ_i| ],   θ_t = θ_0 + λ·τ_MTL ⊙ [ Σ_i m_i ≥ k ].

Source: the TALL mask rule as tanganke/fusion_bench `fusion_bench/method/tall_mask/utils.py`,
`generate_task_masks` (from nik-dim/tall_masks; strict >). What is deployed: the authors' TALL
masks proper give one model *per task*, θ_0 + m_i ⊙ τ_MTL, chosen by the task's identity at test
time (FusionBench's `TallMaskTaskArithmeticAlgorithm.run` returns one model per task); a
continual stream deploys one model for every task, and FoMo-in-Flux's `continual_lib/merge.py`,
`TallMasks.merge`, deploys the consensus: τ_MTL masked to the entries that at least k tasks'
masks keep (`_generate_consensus_mask`), θ_0 + λ·that. That is built here.

Defaults: λ_m = `tall_lambda` = 0.4 and λ = `lam` = 1 (FoMo's `TallMasks.__init__`); k = 2
(the consensus paper's and nik-dim/tall_masks' `prun_thre_k`; FoMo's default
`pruning_threshold=0` keeps every entry, which is plain task arithmetic with λ = 1). So after
the first task (one mask, counts ≤ 1 < k) θ_0 is deployed — what the rule computes. In the
stream, `init=base`: every τ_i = θ̂_i − θ_0 is kept (the masks change with τ_MTL; memory grows
with the stream, as `ties`). `lines=true` applies LiNeS in place of λ. Wraps a base method
(`base=NAME`, default seqft).
"""

from __future__ import annotations

from typing import Any

from cvl.errors import CvlError
from cvl.methods.base import TaskContext
from cvl.methods.merge_ops import consensus
from cvl.methods.merging import LINES, TaskVectorMerge, Weights, clone_weights
from cvl.methods.registry import register


@register("tall_masks")
class TallMasks(TaskVectorMerge):
    """TALL-mask consensus: θ_0 + λ·Σ τ_i where ≥ k = 2 tasks' masks |τ_i| > 0.4·|Σ τ − τ_i| agree."""

    defaults = {"base": "seqft", "tall_lambda": 0.4, "k": 2, "lam": 1.0, "init": "base", **LINES}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        if self.args["k"] < 0 or self.args["tall_lambda"] < 0:
            raise CvlError("method 'tall_masks': k and tall_lambda must be ≥ 0")
        self.taus: list[Weights] = []

    def deploy(self, ctx: TaskContext, tuned: Weights) -> Weights:
        self.taus.append(clone_weights(self.task_vector(tuned), "cpu"))
        initial = self.initial(ctx)
        dev = next(iter(initial.values())).device
        taus = [clone_weights(t, dev) for t in self.taus]
        return self.apply(initial, consensus(taus, self.args["tall_lambda"], self.args["k"]))

    def merge_state(self) -> dict[str, Any]:
        return {"taus": [dict(t) for t in self.taus]} if self.taus else {}

    def load_merge_state(self, state: dict[str, Any]) -> None:
        if "taus" in state:
            self.taus = [dict(t) for t in state["taus"]]
