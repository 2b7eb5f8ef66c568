"""Fine-tuned merge (FoMo-in-Flux's "FT-merge", Roth et al., NeurIPS 2024 D&B; code: the
authors' push in the fork pseudope/fomo_in_flux, MIT): after each task the deployed weights
interpolate the task's fine-tuned weights with the initial (zero-shot) weights θ_0, and the
next task trains from them,

    m_t = ½·θ̂_t + ½·θ_0,   task t trains from m_{t−1} (θ_0 for t = 0),

the first task merged too. In its code: `continual_lib/ft_paint.py`, `Model.unrolled_merge`
returns f_merge([checkpoints[−1], checkpoints[0]]) = f_merge([θ̂_t, θ_0]) (the list starts with
θ_0, `BaseContinualLearner.__init__` in `continual_lib/utils/base_continual_learner.py`;
`Model.end_task` appends θ̂_t), and both `Model.define_training_weights` and
`define_evaluation_weights` use it; f_merge is `continual_lib/merge.py`'s `Interpolation` with
null coefficients (½/½; `configs/config.yaml`, `continual.ft_paint`).

Here: `anchor=initial`, `init=merged`; α = `alpha` = ½ (the weight of θ̂_t). This is what cvl
called `zs_merge` before (same arithmetic). cvl's former `ft_merge`, which merged consecutive
fine-tuned models (θ_t = ½θ̂_t + ½θ̂_{t−1}, training on from θ̂_t), is
`--method wise --method-arg init=finetuned --method-arg anchor=start`. Wraps a base method
(`base=NAME`, default seqft), see `cvl.methods.merging`.
"""

from __future__ import annotations

from cvl.methods.merging import InterpolationMerge
from cvl.methods.registry import register


@register("ft_merge")
class FinetuneMerge(InterpolationMerge):
    """Fine-tuned merge (FoMo-in-Flux): θ_t = ½θ̂_t + ½θ_0 after every task, trained on from θ_t."""

    defaults = {**InterpolationMerge.defaults, "anchor": "initial"}
