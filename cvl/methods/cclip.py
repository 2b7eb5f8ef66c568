"""C-CLIP (Liu, Zhu, Wei & Tian, "C-CLIP: Multimodal Continual Learning for Vision-Language
Model", ICLR 2025): a LoRA per task, integrated into the weights after the task, plus
contrastive knowledge consolidation (CKC) against the previous task's model.

**LoRA integration** (§3, Eq. 2): task t trains a fresh low-rank adapter on the frozen
θ^{t−1}; at its end θ^t = θ^{t−1} + α·ΔW_t, ΔW_t = (α_lora/r)·B·A, with the integration
coefficient α = `alpha` (0.5). The adapter is cvl's `--tune lora` (or `--tune vera`): the
method requires it and scales the task's delta by α just before the loop merges it, so each
checkpoint is the plain θ^t.

**CKC** (§3, Eq. 5), on every batch: the current model's features pass through a trained
projector h_ψ and are contrasted with the frozen old model's features of the same pairs — the
same pair is the positive, the other pairs of the global batch the negatives, both directions:

    h_i = n([h_ψ(f_t(v_i)), h_ψ(g_t(c_i))])        z_i = n([f_{t−1}(v_i), g_{t−1}(c_i)])
    L_CKC = ½·[CE_i(h_i·zᵀ/τ, i) + CE_i(z_i·hᵀ/τ, i)]

(`layout=concat`: each pair's image and text features concatenated, then L2-normalised, n(·);
f, g the *unnormalised* projected embeddings, `image_raw` / `text_raw`), τ = `temp` = 0.07.
Total: L = L_CLIP + `weight`·L_CKC (+ MLM with `--model fusion`); logged `itc`, `cclip_ckc`.

Sources and choices. The official code (SmallPigPeppa/C-CLIP) could not be read here and the
paper's text was not at hand, so the equations above are the paper's as two public
re-implementations transcribe them, and they differ where marked:

- KoyoImai/C-CLIP (`c_clip/losses.py` `CKCLoss`, `c_clip/model.py` `Projector`, `CCLIP`,
  `c_clip/trainer.py`; it cites Eqs. 2, 5, 6 and appendix A.2) — the defaults here: one
  projector shared by both modalities, a 2-layer MLP d → 2d → d with BatchNorm and ReLU
  (`projector=mlp`, `hidden` = 0 → 2d), fed the unnormalised features; image and text features
  concatenated per pair (`layout=concat`), normalised after the concatenation; τ = 0.07; weight
  1 (L = L_CLIP + L_CKC); α = 0.5; CKC on every task *including the first*, whose "old model"
  is the pretrained start (`first_task=true`: cvl's `RUN/init/` weights); the projector is
  kept (and trained on) across tasks (`projector_reset=false`).
- ryder2003/C-CLIP_DynamicRank (`src/losses/cclip_loss.py`
  `ContrastiveKnowledgeConsolidationLoss`, `src/models/cclip.py`): 2N samples, the images and
  texts *stacked* as separate rows ([v_1..v_N, c_1..c_N], a (2N)×(2N) matrix, `layout=stack`),
  one linear projector per modality initialised to the identity (`projector=linear`), reset
  at every task (`projector_reset=true`), CKC from the second task only (`first_task=false`);
  its loss weight 5 and its extra anchor to the pretrained model are its own additions (not
  built). Its projectors read normalised features; here every variant reads `image_raw` /
  `text_raw` (KoyoImai's argument: the projector's BatchNorm needs the norms).
- Both: α = 0.5, τ = 0.07, the old model frozen (the previous task's final, integrated model;
  on task 0 the initial weights), the projector used only for CKC and never deployed (it is
  method state, not part of the checkpoint).
- What trains besides the LoRA (`embeddings`, default true): the token, positional and class
  embeddings of both towers (open_clip's `token_embedding`, `positional_embedding`,
  `visual.class_embedding`, `visual.positional_embedding`; a ResNet tower's attention-pool
  positional embedding too), trained directly. The paper's discussion of its Table 6 says most
  of C-CLIP's trainable parameters are embedding layers; KoyoImai trains these (`CCLIP.__init__`,
  citing the paper's §5.2) and leaves the projections (`text_projection`, `visual.proj`)
  frozen, as here. Their update is not scaled by α (KoyoImai's `merge_lora` scales only the
  LoRA deltas): θ^t keeps the task's trained embeddings. `embeddings=false`: the LoRA alone
  trains (cvl's other adapter methods' rule: embeddings are never adapted).
- The logit scale (`logit_scale`, default false). KoyoImai's code trains CLIP's logit scale
  too since its commit 2f0a559 (2026-03-05: `"logit_scale"` joins the trainable names in
  `c_clip/model.py`; earlier versions had it commented out, and an earlier version of this
  docstring said it stays frozen there, which is no longer true). The paper names embedding
  layers only and the official code could not be read, so the default keeps it frozen (what
  runs made before the option trained); `logit_scale=true` trains it as KoyoImai does now:
  directly (not through the LoRA, not scaled by α), with the base loss's temperature
  following it. Two differences remain: cvl never decays a scalar (KoyoImai's AdamW decays
  every parameter, 0.2) and it learns at `--lr` (KoyoImai: the text group's rate, 10× the
  image one). Only the `clip` model has a logit scale to train (the fusion model's
  temperature is fixed at 0.07): with `--model fusion` the option is refused.
- Not taken from either: their LoRA placement (q/v and MLP of each block) — cvl's `--tune lora`
  targets every linear weight by default (`--tune-arg targets=` narrows it); their per-tower
  learning rates (text 10× image, appendix A.2) — cvl has one `--lr`.

Distributed: the projector runs on the gathered global batch (BatchNorm statistics over all
pairs, as one process computes them) and every rank scores its own rows against all columns,
so N processes × batch B equal one process × N·B.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.dist import gather_no_grad, gather_with_grad, local_rows
from cvl.errors import CvlError
from cvl.methods.base import Method, TaskContext, base_loss
from cvl.methods.registry import register
from cvl.models.tune import scale_adapters_
from cvl.train.accum import frozen_rows

LAYOUTS = ("concat", "stack")
#: the embedding layers C-CLIP trains beside its LoRA (`embeddings=true`; module docstring)
EMBEDDINGS = ("*token_embedding.weight", "*positional_embedding", "*class_embedding")
PROJECTORS = ("mlp", "linear")
#: the CLIP temperature parameter KoyoImai's code trains beside them (`logit_scale=true`)
LOGIT_SCALE = "*logit_scale"


def ckc_loss(
    h: tuple[torch.Tensor, torch.Tensor],
    z: tuple[torch.Tensor, torch.Tensor],
    n_local: int,
    temp: float,
    layout: str = "concat",
) -> torch.Tensor:
    """C-CLIP's CKC over the global batch; `h` = (image, text) of the current model after the
    projector, `z` = the old model's (all ranks' rows, in rank order); this rank's `n_local`
    rows are scored against every column, both directions averaged (module docstring)."""
    rows = local_rows(n_local)
    n = h[0].shape[0]
    if layout == "concat":
        hh = F.normalize(torch.cat(h, dim=-1), dim=-1)
        zz = F.normalize(torch.cat(z, dim=-1).detach(), dim=-1)
        idx = torch.arange(rows.start, rows.stop, device=hh.device)
    else:  # stack: 2N samples [images; texts], each row normalised on its own
        hh = F.normalize(torch.cat(h, dim=0), dim=-1)
        zz = F.normalize(torch.cat(z, dim=0).detach(), dim=-1)
        r = torch.arange(rows.start, rows.stop, device=hh.device)
        idx = torch.cat([r, r + n])
    h2z = hh[idx] @ zz.t() / temp
    z2h = zz[idx] @ hh.t() / temp
    return (F.cross_entropy(h2z, idx) + F.cross_entropy(z2h, idx)) / 2


class Projector(nn.Module):
    """h_ψ: `mlp` = Linear(d, k)-BatchNorm-ReLU-Linear(k, d), one for both modalities
    (KoyoImai); `linear` = one identity-initialised Linear(d, d) per modality (ryder2003)."""

    def __init__(self, kind: str, dim: int, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "mlp":
            k = hidden or 2 * dim
            self.net = nn.Sequential(
                nn.Linear(dim, k), nn.BatchNorm1d(k), nn.ReLU(), nn.Linear(k, dim)
            )
        else:
            self.image = nn.Linear(dim, dim)
            self.text = nn.Linear(dim, dim)

    @torch.no_grad()
    def reset(self, generator: torch.Generator) -> None:
        """nn.Linear's own initialisation drawn from `generator` (mlp), the identity (linear)."""
        for m in self.modules():
            if isinstance(m, nn.Linear) and self.kind == "mlp":
                w = torch.empty(m.weight.shape)
                nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
                bound = 1 / math.sqrt(m.in_features)
                m.weight.copy_(w)
                m.bias.copy_(torch.empty(m.bias.shape).uniform_(-bound, bound, generator=generator))
            elif isinstance(m, nn.Linear):
                m.weight.copy_(torch.eye(m.in_features))
                m.bias.zero_()
            elif isinstance(m, nn.BatchNorm1d):
                m.reset_parameters()

    def forward(self, x: torch.Tensor, modality: str) -> torch.Tensor:
        if self.kind == "mlp":
            return self.net(x)
        return (self.image if modality == "image" else self.text)(x)


@register("cclip")
class CCLIP(Method):
    """C-CLIP: a LoRA per task integrated with α, + CKC through a projector against the old model."""

    defaults = {
        "weight": 1.0,
        "temp": 0.07,
        "alpha": 0.5,
        "projector": "mlp",
        "hidden": 0,
        "layout": "concat",
        "first_task": True,
        "projector_reset": False,
        "embeddings": True,
        "logit_scale": False,
    }
    tunes = ("lora", "vera")

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.check_choice("layout", LAYOUTS)
        self.check_choice("projector", PROJECTORS)
        if self.args["temp"] <= 0:
            raise CvlError(f"method 'cclip': temp must be positive (got {self.args['temp']})")
        if self.args["hidden"] < 0:
            raise CvlError(f"method 'cclip': hidden must be >= 0 (got {self.args['hidden']})")
        self.old: nn.Module | None = None
        self.projector: Projector | None = None
        also = EMBEDDINGS if self.args["embeddings"] else ()
        self.tune_also = also + (LOGIT_SCALE,) if self.args["logit_scale"] else also

    def _seed(self, ctx: TaskContext, task: int) -> torch.Generator:
        from cvl.data.reader import sample_seed

        return torch.Generator().manual_seed(sample_seed(int(ctx.config.seed), task, 547))

    def setup(self, ctx: TaskContext) -> None:
        if self.args["logit_scale"] and not any(
            n.split(".")[-1] == "logit_scale" for n, _ in ctx.model.named_parameters()
        ):
            raise CvlError(
                "method 'cclip': logit_scale=true trains the model's logit scale, and this "
                "model has none to train (the fusion model's temperature is fixed at 0.07)"
            )
        p = Projector(self.args["projector"], int(ctx.model.embed_dim), self.args["hidden"])
        p.reset(self._seed(ctx, 0))
        dtype = next(ctx.model.parameters()).dtype
        self.projector = p.to(ctx.device, dtype).train()

    def before_task(self, ctx: TaskContext) -> None:
        if ctx.task_index > 0:
            self.old = ctx.previous_model()
        else:
            self.old = ctx.initial_model() if self.args["first_task"] else None
        if self.args["projector_reset"] and ctx.task_index > 0:  # resume: the state replaces it
            self.projector.reset(self._seed(ctx, ctx.task_index))

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = base_loss(ctx.model, batch, out, ctx)
        if self.old is None:
            return terms
        with torch.no_grad():
            z = (
                gather_no_grad(frozen_rows(self.old.encode_image, batch["image"], normalize=False)),
                gather_no_grad(frozen_rows(self.old.encode_text, batch["text"], normalize=False)),
            )
        # the projector on the global batch: BatchNorm over every rank's pairs
        h = (
            self.projector(gather_with_grad(out["image_raw"]), "image"),
            self.projector(gather_with_grad(out["text_raw"]), "text"),
        )
        a = self.args
        n = out["image_raw"].shape[0]
        terms["cclip_ckc"] = a["weight"] * ckc_loss(h, z, n, a["temp"], a["layout"])
        return terms

    def after_task(self, ctx: TaskContext) -> None:
        """θ^t = θ^{t−1} + α·ΔW_t: the delta scaled here, merged by the loop right after."""
        scale_adapters_(ctx.model, self.args["alpha"])

    def extra_parameters(self) -> list[nn.Parameter]:
        return list(self.projector.parameters()) if self.projector is not None else []

    def state_dict(self) -> dict[str, Any]:
        return {"projector": dict(self.projector.state_dict())} if self.projector else {}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.projector.state_dict(keep_vars=True)
        for k, v in (state.get("projector") or {}).items():
            mine[k].copy_(v)  # in place: the optimizer holds these tensors
