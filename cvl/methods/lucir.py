"""LUCIR (Hou et al. 2019) as adapted by CTP (appendix B.2; CTP code): herding (mof) buffer +
cosine-normalised projection layers + "less-forget" feature distillation + MLM distillation.

- **Cosine projections** (from the first task on): the image and text projections compute
  σ·⟨x/‖x‖, W_j/‖W_j‖⟩ without bias (the CTP code's `CosineLinear`). The contrastive
  features are L2-normalised right after the projection, which removes σ and the input norm
  ‖x‖ exactly, so what changes is that each output unit's weight vector is normalised in the
  forward pass (the gradient flows through the normalisation) and the bias is gone. We do
  that without changing the architecture: the projection weight is read through
  W/‖W‖ (rows of a `Linear`; columns of open_clip's `x @ proj` matrices), the bias is zeroed
  and frozen, σ is omitted (it would receive no gradient). After every task the stored
  weights are normalised in place (a fixed point of the forward), so the saved checkpoints
  compute the same features when loaded into the plain architecture by `cvl eval`. Projections:
  `fusion`: `vision_proj`, `text_proj`; `clip`: the ViT's `proj` or the ModifiedResNet's
  attention-pool output `c_proj`, and `text_projection`.
- **Feature distillation** on task t > 0, against the previous task's model: 1 − cos(old, new).
  `fusion`: on the token hidden states (CTP code): all ViT output tokens and all text-encoder
  token states (padding positions included, as the code), each averaged over positions and
  items, the two modalities averaged. `clip` exposes no token states: on the image and text
  embeddings (LUCIR's original L_dis^G on normalised features).
- **MLM distillation** (`fusion`), as in LwF (`cvl.methods.lwf`), T = `distill_temp` = 1.
- No margin-ranking term: it needs class labels (CTP appendix B.2).

Total: L_base + `feature_weight`·L_feat + `mlm_distill_weight`·L_mlm^d (weights 1, CTP code).
Needs `--buffer mof --buffer-size N`. Logged terms: itc (+ mlm), `lucir_feat`, `lucir_mlm`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.errors import CvlError
from cvl.losses import cosine_distance
from cvl.methods.base import TaskContext
from cvl.methods.icarl import require_mof
from cvl.methods.lwf import LwF
from cvl.methods.registry import register


def cosine_normalize(module: nn.Module, attr: str, dim: int) -> None:
    """Read parameter `attr` of `module` as F.normalize(raw, dim) from now on (in place).

    The module's class is swapped for a subclass with a property of that name; the raw tensor
    stays in `_parameters` (same state-dict key, same optimizer entry), so checkpoints and
    resume are unchanged. Idempotent.
    """
    cls = type(module)
    done = getattr(cls, "_cvl_cosine", ())
    if attr in done:
        return

    def get(self: nn.Module) -> torch.Tensor:
        return F.normalize(self._parameters[attr], dim=dim)

    new = type(f"Cosine{cls.__name__}", (cls,), {attr: property(get), "_cvl_cosine": (*done, attr)})
    module.__class__ = new


def projection_slots(model: Any) -> tuple[list[tuple[nn.Module, str, int]], list[nn.Parameter]]:
    """([(module, parameter name, normalised dim)], [biases to drop]) of the two projections."""
    if getattr(model, "has_fusion", False):
        slots = [(model.vision_proj, "weight", 1), (model.text_proj, "weight", 1)]
        biases = [m.bias for m in (model.vision_proj, model.text_proj) if m.bias is not None]
        return slots, biases
    clip = getattr(model, "clip", None)
    visual = getattr(clip, "visual", None)
    slots, biases = [], []
    if visual is not None and visual._parameters.get("proj") is not None:
        slots.append((visual, "proj", 0))
    elif hasattr(visual, "attnpool") and hasattr(visual.attnpool, "c_proj"):
        slots.append((visual.attnpool.c_proj, "weight", 1))
        if visual.attnpool.c_proj.bias is not None:
            biases.append(visual.attnpool.c_proj.bias)
    tp = getattr(clip, "text_projection", None)
    if clip is not None and clip._parameters.get("text_projection") is not None:
        slots.append((clip, "text_projection", 0))
    elif isinstance(tp, nn.Linear):
        slots.append((tp, "weight", 1))
        if tp.bias is not None:
            biases.append(tp.bias)
    if len(slots) != 2:
        raise CvlError(
            "lucir: cannot find this model's image and text projections (supported: the fusion "
            "model, open_clip CLIP with a ViT or ModifiedResNet image tower)"
        )
    return slots, biases


@torch.no_grad()
def make_cosine_projections(model: Any) -> None:
    """Cosine-normalised projections: normalised weight in the forward, bias zero and frozen."""
    from torch.nn.utils import parametrize

    slots, biases = projection_slots(model)
    for module, attr, _ in slots:
        if parametrize.is_parametrized(module, attr):
            raise CvlError(
                "lucir normalises the projection weights itself; with --tune lora/dora keep "
                "adapters off them (--tune-arg targets=PATTERNS, e.g. '*transformer*')"
            )
    for module, attr, dim in slots:
        cosine_normalize(module, attr, dim)
    for b in biases:
        b.zero_()
        b.requires_grad_(False)


@torch.no_grad()
def store_normalized(model: Any) -> None:
    """Write W/‖W‖ into the projections' stored weights (a fixed point of the cosine forward)."""
    for module, attr, dim in projection_slots(model)[0]:
        raw = module._parameters[attr]
        raw.copy_(F.normalize(raw, dim=dim))


@register("lucir")
class LUCIR(LwF):
    """LUCIR: mof buffer + cosine-normalised projections + 1−cos feature and MLM distillation."""

    defaults = {"feature_weight": 1.0, "mlm_distill_weight": 1.0, "distill_temp": 1.0}
    needs_buffer = True
    buffer_hint = "mof"
    #: cvl.train.fsdp: what the method lacks under --fsdp
    fsdp = (
        "its cosine-normalised projections are a parametrization added to the model after it "
        "is sharded (FSDP2 would gather the projections' old parameters)"
    )
    prefix = "lucir"

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super(LwF, self).__init__(args)  # no LwF variant to check

    def setup(self, ctx: TaskContext) -> None:
        require_mof(ctx, self.name)
        make_cosine_projections(ctx.model)

    def distill(self, batch: dict, out: dict, old_out: dict, ctx: TaskContext) -> dict:
        if getattr(ctx.model, "has_fusion", False):
            feat = (
                cosine_distance(out["image_embeds"], old_out["image_embeds"])
                + cosine_distance(out["text_hidden"], old_out["text_hidden"])
            ) / 2
        else:
            feat = (
                cosine_distance(out["image_features"], old_out["image_features"])
                + cosine_distance(out["text_features"], old_out["text_features"])
            ) / 2
        return {"lucir_feat": self.args["feature_weight"] * feat}

    def after_task(self, ctx: TaskContext) -> None:
        store_normalized(ctx.model)
