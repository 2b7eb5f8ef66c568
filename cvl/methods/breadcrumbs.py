"""Model Breadcrumbs (Davari & Belilovsky, ECCV 2024, "Model breadcrumbs: scaling multi-task
model merging with sparse masks"): each task vector keeps, per layer, a middle band of its
entries by magnitude (the large outliers and the small bulk are masked), and the masked vectors
are added as in task arithmetic,

    τ̃_i = mask_{γ,β}(τ_i),   θ_t = θ_0 + α·Σ_{i≤t} τ̃_i.

Source: rezazzr/breadcrumbs, `src/task_vectors.py`, `TaskVectorMiddleKeep` (remove_first=True):
per tensor, along its last dimension (each row of n entries; a 1-d tensor is one row), the top
⌊n·γ⌋ entries by |value| are zeroed (`mask_remove_top`, γ = `remove`), then only the top ⌊n·β⌋
of what is left are kept (`mask_keep_top`, β = `keep`): entries ranked ⌊nγ⌋ .. ⌊nγ⌋+⌊nβ⌋−1 from
the top survive, the bottom 1 − γ − β go. 0-d tensors (CLIP's logit scale) are kept whole, as
the code does. Defaults: the README's example (α = `lam` = 0.4, β = 0.2, γ = 0.1). In the code
the names are swapped from the usual reading: its β is the fraction *kept*, its γ the top
fraction removed (the paper's "top-β / bottom-γ" wording describes the same band). Ties in
|value| are broken by `torch.topk` (as the code). In the stream, `init=base` (default): every task
trains from θ_0 (the task models of the paper); only the running Σ τ̃_i is kept. FoMo-in-Flux's
`BreadcrumbsTIES` (masks over the whole flattened vector, then TIES's sign election and a sum)
is not this. `lines=true` applies LiNeS in place of α. Wraps a base method (`base=NAME`).
"""

from __future__ import annotations

from typing import Any

from cvl.errors import CvlError
from cvl.methods.base import TaskContext
from cvl.methods.merge_ops import breadcrumbs
from cvl.methods.merging import LINES, Weights
from cvl.methods.registry import register
from cvl.methods.task_arith import TaskArithmetic


@register("breadcrumbs")
class Breadcrumbs(TaskArithmetic):
    """Model Breadcrumbs: per row drop the top γ = 0.1 and keep the next β = 0.2 by |τ|; θ_0 + 0.4·Σ."""

    defaults = {"base": "seqft", "keep": 0.2, "remove": 0.1, "lam": 0.4, "init": "base", **LINES}

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        keep, remove = self.args["keep"], self.args["remove"]
        if not (0.0 <= keep <= 1.0 and 0.0 <= remove < 1.0 and keep + remove <= 1.0):
            raise CvlError(
                f"method 'breadcrumbs': keep and remove must be fractions with keep + remove ≤ 1 "
                f"(got {keep}, {remove})"
            )

    def vector(self, ctx: TaskContext, tuned: Weights) -> Weights:
        return breadcrumbs(self.task_vector(tuned), self.args["keep"], self.args["remove"])
