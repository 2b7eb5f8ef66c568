"""WiSE: weight-space ensembling of each task's final weights with the previous task's.

After task t (t > 0) the final weights become

    θ_t ← α·θ̂_t + (1 − α)·θ_{t−1}

with θ_{t−1} the previous task's saved final weights (themselves already interpolated), α =
`alpha` = 0.5 (the weight of the new task). This is WiSE-FT (Wortsman et al. 2022)
interpolation between fine-tuned and starting weights, applied at every task boundary;
`first_task=true` also interpolates task 0 with the run's initial (e.g. pre-trained) weights,
which is WiSE-FT proper, and then is FoMo-in-Flux's EMA-merge (`ema_merge`). All
floating-point weights and buffers that `--tune` trains are interpolated (`cvl.methods.
merging.InterpolationMerge`, the one class behind `wise`, `ema_merge`, `zs_merge` and
`ft_merge`). Its arguments choose the other schedules: `init=finetuned anchor=start` trains on
from the fine-tuned weights and merges consecutive fine-tuned models (θ_t = α·θ̂_t +
(1 − α)·θ̂_{t−1}: cvl's former `ft_merge`).

Combining with other methods: `wise` wraps a **base method** named by `--method-arg
base=NAME` (default `seqft`); every other `--method-arg` goes to the base method, which runs
unchanged (its losses, hooks and state), and the interpolation happens after its `after_task`
(so e.g. EWC's Fisher is measured on the un-interpolated weights, its next anchor θ* is the
interpolated model; a replay buffer selects with the interpolated model). Example:
`--method wise --method-arg base=lwf --method-arg alpha=0.7 --method-arg variant=logits`.
"""

from __future__ import annotations

from cvl.methods.base import Wrapper  # noqa: F401  (re-exported: its former home)
from cvl.methods.merging import InterpolationMerge, floating_state, interpolate_  # noqa: F401
from cvl.methods.registry import register


@register("wise")
class WiSE(InterpolationMerge):
    """WiSE: after each task, θ ← α·θ + (1−α)·θ_previous-task (wraps a base method, default seqft)."""

    defaults = {**InterpolationMerge.defaults, "first_task": False}
