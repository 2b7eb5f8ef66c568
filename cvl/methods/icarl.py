"""iCaRL (Rebuffi et al. 2017) as adapted by CTP (appendix B.2): a mean-of-features (herding)
replay buffer + LwF distillation on every batch, i.e. on buffer and new items alike (the loop
mixes the buffer into the task's data). There is no class concept in vision-language
pretraining, so no nearest-mean-of-exemplars classifier: what remains is exactly
`--buffer mof` + `lwf` (`cvl.methods.lwf`; both of its variants; default the CTP code's
feature softmax + MLM distillation). Needs `--buffer mof --buffer-size N` (CTP: 10,000 pairs,
about 1 % of P9D). Logged terms: itc (+ mlm), `icarl_kd`, `icarl_mlm`.
"""

from __future__ import annotations

from cvl.errors import CvlError
from cvl.methods.base import TaskContext
from cvl.methods.lwf import LwF
from cvl.methods.registry import register


def require_mof(ctx: TaskContext, name: str) -> None:
    """A clear error unless the run uses the herding (mof) buffer."""
    buf = getattr(ctx.config, "buffer", None)
    if buf != "mof":
        raise CvlError(
            f"method '{name}' selects its exemplars by herding: use --buffer mof --buffer-size N"
            + (f" (got --buffer {buf})" if buf else "")
        )


@register("icarl")
class ICaRL(LwF):
    """iCaRL: herding (mof) buffer + LwF distillation on buffer and new items (CTP's adaptation)."""

    needs_buffer = True
    buffer_hint = "mof"
    prefix = "icarl"

    def setup(self, ctx: TaskContext) -> None:
        require_mof(ctx, self.name)
