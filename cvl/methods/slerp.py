"""SLERP merge (FoMo-in-Flux's EMA-merge with its `slerp` operator; pseudope/fomo_in_flux,
`continual_lib/merge.py`, `SLERP`): after each task the deployed weights are, per tensor, the
spherical interpolation of the task's fine-tuned weights and the previous deployed ones, and
the next task trains from them,

    θ_t = sin(α·ω)/sin ω · θ̂_t + sin((1−α)·ω)/sin ω · θ_{t−1},   cos ω = ⟨θ̂_t, θ_{t−1}⟩/(‖θ̂_t‖·‖θ_{t−1}‖),

θ_{−1} = θ_0 (the first task merged too), per tensor over all its entries; where |cos ω| >
0.9995 (near-parallel tensors) the linear (1 − α)·θ_{t−1} + α·θ̂_t instead (`SLERP.slerp`,
DOT_THRESHOLD = 0.9995, a norm ≤ 1e-8 not normalised). As in its code the weights themselves
are interpolated, not task vectors. FoMo's `ema_paint.py` folds f_merge([θ̂_i, running]) from θ_0
(`Model.unrolled_merge`) for training and evaluation alike: `init=merged`, `anchor=previous`,
`first_task=true` here, as `ema_merge`. α = `alpha` = ½ (FoMo's null coefficients → ½/½).

Where the code reads oddly: its first coefficient w weights its *second* model (v0_mul =
sin(ω(1 − w))/sin ω on v0 = θ̂_t), opposite to its `Interpolation`; cvl's α is the weight of θ̂_t
in both operators (FoMo's w = 1 − α; at ½ they agree). The cosine is computed in float64 (FoMo:
in the tensors' dtype, `.item()`). Other anchors / inits as `wise` (`anchor=`, `init=`,
`first_task=`). Wraps a base method (`base=NAME`, default seqft); `cvl.methods.merging.slerp` /
`merge_ops.slerp` hold the arithmetic.
"""

from __future__ import annotations

from cvl.methods.merging import InterpolationMerge
from cvl.methods.registry import register


@register("slerp")
class Slerp(InterpolationMerge):
    """SLERP merge: per tensor θ_t = slerp(θ̂_t, θ_{t−1}; ½) after every task, trained on from θ_t."""

    operator = "slerp"
    defaults = {**InterpolationMerge.defaults, "first_task": True}
