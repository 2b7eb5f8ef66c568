"""DER / DER++: dark experience replay (Buzzega et al. 2020), as Mod-X and DHA adapt it.

The replay buffer (any strategy, `--buffer reservoir --buffer-size N`; Mod-X: 3,000 pairs,
DHA: a ring buffer of 5 %) also stores, for every item, the model's **output when the item
was stored**: its L2-normalised image and text embeddings v*, w* (the CLIP model's outputs;
"we save logits instead of raw inputs and old models", DHA appendix B). Items enter the buffer
at the end of a task, so the stored output is that task's final model's, computed once with
the evaluation transform (no augmentation) and kept while the item stays in the buffer (items
of older tasks keep their older targets: DER's "dark knowledge" of the past). The targets are
computed by all ranks (each embeds its part, then gathered), so every rank holds the same
rows whichever process embedded the item; they are part of the buffer state (safetensors).

The loop mixes the buffer's items into the task's batches. With B = the buffer rows of the
global batch, C = the current-task rows::

    DER:    L = InfoNCE(anchors C, candidates C) + α · ½ [MSE(v_B, v*_B) + MSE(w_B, w*_B)]
    DER++:  L_DER + β · InfoNCE(anchors B, candidates C ∪ B)

MSE = mean over the global buffer rows and the embedding dimensions (Mammoth's
`F.mse_loss`); InfoNCE with the CLIP scale over the global batch (`masked_clip_loss`). Plain
DER trains the contrastive loss on the new data only ("only the logits of previous sample pairs
are aligned", DHA); DER++ (`derpp=true`) adds the replay contrastive term (Mammoth DER++'s
cross-entropy on buffer labels; Mammoth draws a second buffer batch, here the buffer rows of
the mixed batch serve). Defaults α = 0.3, β = 0.5 (Mammoth's DER/DER++ settings). Choice: the
stored output is the embedding pair, not a row of a similarity matrix (a row depends on the
batch it was computed in, so it cannot be replayed against another batch). On the first task
there is no buffer yet: the base loss. A fusion model adds its MLM loss on all rows.
Logged terms: `itc`, `der_mse`, (`der_replay`), (`mlm`); metric `der_buffer_rows`.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.data.index import Entries
from cvl.data.reader import PairDataset, eval_loader
from cvl.data.transforms import image_transform
from cvl.errors import CvlError
from cvl.losses import global_masked_mean, masked_clip_loss
from cvl.methods.base import Method, TaskContext, mlm_term
from cvl.methods.registry import register
from cvl.train.fsdp import gathered

IMAGE, TEXT = "der_image", "der_text"


@torch.no_grad()
def embed_pairs(model: Any, entries: Entries, accelerator: Any, batch_size: int = 256):
    """(v, w): normalised image and text embeddings of `entries` (evaluation transform), in
    order, computed in parts by all ranks and gathered (every rank gets all rows)."""
    from cvl.evaluation.embed import _gather_rows

    ds = PairDataset(entries, image_transform(model.image_size, train=False), model.tokenizer)
    was = model.training
    model.eval()
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    vs, ws = [], []
    with gathered(model):  # --fsdp: ranks may embed different numbers of batches
        for b in eval_loader(ds, batch_size, rank=rank, world=world):
            vs.append(model.encode_image(b["image"].to(device)).float().cpu())
            ws.append(model.encode_text(b["text"].to(device)).float().cpu())
    model.train(was)
    d = model.embed_dim
    v = torch.cat(vs) if vs else torch.zeros(0, d)
    w = torch.cat(ws) if ws else torch.zeros(0, d)
    return _gather_rows(v, accelerator, len(ds)), _gather_rows(w, accelerator, len(ds))


@register("der")
class DER(Method):
    """DER / DER++: the buffer keeps each item's embeddings from when it was stored; MSE to them."""

    itc_only = True  # its own contrastive objective: no --base-loss class-ce
    defaults = {"alpha": 0.3, "derpp": False, "beta": 0.5}
    needs_buffer = True

    def setup(self, ctx: TaskContext) -> None:
        if ctx.buffer is None:
            raise CvlError(
                "method 'der' needs a replay buffer: add --buffer reservoir --buffer-size N"
            )

    def before_task(self, ctx: TaskContext) -> None:
        """Store the targets of the items the buffer took after the previous task.

        The model here is still that task's final model (nothing trained yet; on resume the
        mid-task weights are loaded after this hook), i.e. the model at storage time.
        """
        missing = ctx.buffer.keys_without(IMAGE)
        if not missing:
            return
        v, w = embed_pairs(ctx.model, ctx.buffer.entries_at(missing), ctx.accelerator)
        ctx.buffer.set_payload(missing, **{IMAGE: v, TEXT: w})

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        a = self.args
        v, w, s = out["image_features"], out["text_features"], out["logit_scale"]
        old, v_star = ctx.buffer.payload_rows(batch, IMAGE, v)
        _, w_star = ctx.buffer.payload_rows(batch, TEXT, w)
        cur = ~old
        terms = {"itc": masked_clip_loss(v, w, s, anchors=cur, candidates=cur)}
        if getattr(ctx.model, "has_fusion", False):
            terms["mlm"] = mlm_term(ctx.model, batch, out, ctx)[0]
        if ctx.first_task:
            return terms
        per_row = ((v - v_star) ** 2).mean(-1) + ((w - w_star) ** 2).mean(-1)
        terms["der_mse"] = a["alpha"] * global_masked_mean(per_row / 2, old)
        if a["derpp"]:
            terms["der_replay"] = a["beta"] * masked_clip_loss(v, w, s, anchors=old)
        ctx.metrics["der_buffer_rows"] = old.float().mean()  # a tensor: no host sync
        return terms
