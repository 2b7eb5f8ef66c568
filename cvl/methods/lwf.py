"""LwF: learning without forgetting (Li & Hoiem 2017; CTP appendix B.1; CTP code; Mod-X/DHA/DKR).

The previous task's final model (old, frozen) sees the current batch; the training model is
pulled towards its outputs. Two readings, chosen by `variant`:

- `feature` (default; the CTP code, the Table 1 row): per item, a distribution over the
  *embedding dimensions* of the unnormalised projected features (`image_raw`, `text_raw`),
  softmax(x/τ) with τ = `temp` = 0.07:

      L_kd = ½·[KL(softmax(v'/τ) ‖ softmax(v/τ)) + KL(softmax(w'/τ) ‖ softmax(w/τ))]

  (rows summed over dimensions, averaged over items: the code's `batchmean`; the paper calls it
  the cross-entropy, which has the same gradient);
- `logits` (how Mod-X, DHA and DKR describe LwF): the old model's image-text similarity
  distributions over the **global** batch as targets, i2t and t2i rows:

      L_kd = ½·[KL(softmax(s'·v'w'ᵀ) ‖ softmax(s·vwᵀ)) + KL(softmax(s'·w'v'ᵀ) ‖ softmax(s·wvᵀ))]

  with each model's own logit scale s = 1/τ (`logit_temp` > 0 sets one fixed τ for both).

With the `fusion` model both add MLM distillation at the masked positions (CTP code, T =
`distill_temp` = 1): L_mlm^d = −Σ softmax(old MLM logits/T)·log softmax(MLM logits/T), averaged
over the masked tokens of the global batch, on the same masked ids (the old model's forward
gets them, so one old forward gives its features and its MLM logits).

Total on task t > 0: L_base (ITC, or `--base-loss class-ce`) + `weight`·L_kd + `mlm_distill_weight`·L_mlm^d (weights 1, CTP
code). Task 0: base loss only. Logged terms: itc (+ mlm), `lwf_kd`, `lwf_mlm`.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.checks import NON_NEGATIVE_FLOAT, POSITIVE_FLOAT
from cvl.losses import global_mlm_distillation, kl_rows, old_new_global_logits
from cvl.methods.base import PreviousModelMethod, TaskContext, base_terms, mlm_term
from cvl.methods.registry import register
from cvl.train.accum import frozen_rows

VARIANTS = ("feature", "logits")


def feature_kd(
    raw_image: torch.Tensor,
    raw_text: torch.Tensor,
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    temp: float,
) -> torch.Tensor:
    """The CTP code's LwF: KL(old ‖ new) of softmax(features/τ) over the embedding dimensions."""
    ki = kl_rows(old_image.detach() / temp, raw_image / temp)
    kt = kl_rows(old_text.detach() / temp, raw_text / temp)
    return (ki + kt) / 2


def logit_kd(
    image: torch.Tensor,
    text: torch.Tensor,
    old_image: torch.Tensor,
    old_text: torch.Tensor,
    scale: torch.Tensor | float,
    old_scale: torch.Tensor | float,
) -> torch.Tensor:
    """Similarity-logit LwF: KL(old ‖ new) of the i2t and t2i rows over the global batch."""
    m = old_new_global_logits(image, text, old_image, old_text, scale, old_scale)
    return (kl_rows(m["old_i2t"], m["i2t"]) + kl_rows(m["old_t2i"], m["t2i"])) / 2


@register("lwf")
class LwF(PreviousModelMethod):
    """LwF: distil the previous task's model (feature softmax, or similarity logits) + MLM."""

    defaults = {
        "variant": "feature",
        "temp": 0.07,
        "logit_temp": 0.0,
        "weight": 1.0,
        "mlm_distill_weight": 1.0,
        "distill_temp": 1.0,
    }
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {
        "temp": POSITIVE_FLOAT,
        "logit_temp": NON_NEGATIVE_FLOAT,
        "distill_temp": POSITIVE_FLOAT,
    }
    prefix = "lwf"

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.check_choice("variant", VARIANTS)

    def kd(self, out: dict, old_out: dict) -> torch.Tensor:
        a = self.args
        if a["variant"] == "feature":
            return feature_kd(
                out["image_raw"],
                out["text_raw"],
                old_out["image_raw"],
                old_out["text_raw"],
                a["temp"],
            )
        if a["logit_temp"] > 0:
            scale = old_scale = 1.0 / a["logit_temp"]
        else:
            scale, old_scale = out["logit_scale"], old_out["logit_scale"]
        return logit_kd(
            out["image_features"],
            out["text_features"],
            old_out["image_features"],
            old_out["text_features"],
            scale,
            old_scale,
        )

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        a, model = self.args, ctx.model
        fusion = getattr(model, "has_fusion", False)
        terms = base_terms(batch, out, ctx)  # ITC, or --base-loss class-ce
        if fusion:
            terms["mlm"], logits, masked, labels = mlm_term(model, batch, out, ctx)
        if self.old is None:
            return terms
        with torch.no_grad():
            if fusion:
                old_out = frozen_rows(self.old, batch["image"], batch["text"], mlm_ids=masked)
            else:
                old_out = frozen_rows(self.old, batch["image"], batch["text"])
        terms.update(self.distill(batch, out, old_out, ctx))
        if fusion and a["mlm_distill_weight"]:
            terms[f"{self.prefix}_mlm"] = a["mlm_distill_weight"] * global_mlm_distillation(
                logits, old_out["mlm_logits"], labels, a["distill_temp"]
            )
        return terms

    def distill(self, batch: dict, out: dict, old_out: dict, ctx: TaskContext) -> dict:
        """The representation distillation term(s) (LUCIR overrides this)."""
        return {f"{self.prefix}_kd": self.args["weight"] * self.kd(out, old_out)}
