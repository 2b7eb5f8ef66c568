"""EMA merge (FoMo-in-Flux's "EMA-merge", Roth et al., NeurIPS 2024 D&B; code: the authors'
push in the fork pseudope/fomo_in_flux, MIT): once per task end, the deployed weights are an
exponential moving average over tasks of the fine-tuned models, and the next task trains from
them,

    m_t = ½·θ̂_t + ½·m_{t−1},   m_{−1} = θ_0,   task t trains from m_{t−1},

so the first task is merged too (m_0 = ½θ̂_0 + ½θ_0). In its code: `continual_lib/utils/
base_continual_learner.py`, `BaseContinualLearner.__init__` starts the list of checkpoints
`checkpoint_storage["running"]` with θ_0; `continual_lib/ema_paint.py`, `Model.end_task`
appends θ̂_t to it, and `Model.define_training_weights` / `define_evaluation_weights` both
set `Model.unrolled_merge` of that list (running ← f_merge([θ̂_i, running]) from θ_0 on), which
`BaseContinualLearner.prepare_for_training` / `prepare_for_evaluation` load (`utils/
training.py`, `train`: before each task's steps / after its `end_task`); f_merge is
`continual_lib/merge.py`'s `Interpolation` with `weight_coefficients: null`
(`configs/config.yaml`, `continual.ema_paint`), the mean: ½/½. FoMo-in-Flux merges the backbone
and the head state dicts alike, i.e. the whole model (see `cvl.methods.merging` for what cvl
merges under `--tune`: the adapted weights as they compute, frozen tensors left as they are).

α = `alpha` = ½ is the weight of the new model (FoMo's coefficients [α, 1 − α]). This is
`wise` with `first_task=true` (the same class, `cvl.methods.merging.InterpolationMerge`); the
former cvl `ema_merge`, a per-step EMA of the weights, is `ema_step`. Wraps a base method
(`base=NAME`, default seqft).

`best_in_time` is TIME's recommendation under its own name (Dziadzio et al., CVPR 2025, "How to
merge your multimodal models over time?"; explainableml/time, not readable here): of its three
axes (initialisation, deployment, merging technique), "Best-in-TIME" initialises each task from
the EMA of the past models and deploys that EMA, with plain weighted averaging as the merge
(the paper's summary: EMA for both phases; the merging technique matters little). That is this
class: task t trains from m_{t−1} (`init=merged`), deploys m_t = α·θ̂_t + (1 − α)·m_{t−1}
(`anchor=previous`, the first task merged with θ_0), α = ½ as in the authors' FoMo-in-Flux push
(`ema_paint.py` with `Interpolation`'s null coefficients), which is the code TIME's study ran
on. If the paper's EMA weight differs from ½, set `alpha` (the preset keeps FoMo's ½).
"""

from __future__ import annotations

from cvl.methods.merging import InterpolationMerge
from cvl.methods.registry import register


@register("ema_merge")
class EMAMerge(InterpolationMerge):
    """EMA merge (FoMo-in-Flux): θ_t = ½θ̂_t + ½θ_{t−1} after every task, trained on from θ_t."""

    defaults = {**InterpolationMerge.defaults, "first_task": True}


@register("best_in_time")
class BestInTime(EMAMerge):
    """TIME's Best-in-TIME preset: EMA initialisation and EMA deployment (= ema_merge, α = ½)."""

    #: the registered method this name is a preset of (same class behaviour and defaults)
    preset_of = "ema_merge"
