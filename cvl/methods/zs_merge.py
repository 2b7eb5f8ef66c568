"""Zero-shot merge (FoMo-in-Flux's "ZS-merge", Roth et al., NeurIPS 2024 D&B; code: the
authors' push in the fork pseudope/fomo_in_flux, MIT): every task trains from the initial
(zero-shot) weights θ_0, and the deployed model is a running merge of all task models,

    task t trains from θ_0,   m_t = ½·θ̂_t + ½·m_{t−1},   m_{−1} = θ_0.

In its code: `continual_lib/zs_paint.py`, `Model.prepare_for_training` loads
`checkpoint_storage["init"]` (θ_0) before every task; `Model.end_task` appends θ̂_t to
`checkpoint_storage["running"]` (which `BaseContinualLearner.__init__`,
`continual_lib/utils/base_continual_learner.py`, starts with θ_0), and
`Model.define_evaluation_weights` sets `Model.unrolled_merge` of it (running ←
f_merge([θ̂_i, running]) from θ_0 on), f_merge being `continual_lib/merge.py`'s
`Interpolation` with null coefficients (½/½; `configs/config.yaml`, `continual.zs_paint`).

Here: `init=base` (every task from θ_0) and `anchor=previous` (the deployed θ_{t−1}, kept in the
method state on the CPU during the task: one copy of the trained weights). α = `alpha` = ½.
cvl's former `zs_merge` (θ_t = ½θ̂_t + ½θ_0, training on from θ_t) is FoMo's FT-merge:
`ft_merge`. Wraps a base method (`base=NAME`, default seqft), see `cvl.methods.merging`.
"""

from __future__ import annotations

from cvl.methods.merging import InterpolationMerge
from cvl.methods.registry import register


@register("zs_merge")
class ZeroShotMerge(InterpolationMerge):
    """Zero-shot merge (FoMo-in-Flux): every task from θ_0; θ_t = ½θ̂_t + ½θ_{t−1}."""

    defaults = {**InterpolationMerge.defaults, "init": "base"}
