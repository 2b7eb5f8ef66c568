"""IncCLIP: generative negative text replay + cross-modal distillation (Yan et al., ECCV'22, §3).

Needs a replay memory (`--buffer reservoir --buffer-size N`, reservoir sampling after each
task as in the paper; any strategy works). On task t > 0, with H_{t-1} the previous task's
model (frozen) and B the global batch:

1. **Pseudo negative texts** (§3.2, Eq. 1), once per optimizer step, before the forward:
   sample a mini-batch of `gen_images` memory pairs (default: B, as in the paper); draw
   i, j ∈ [0, B) and β ~ U[0, 1] for each of the B̂ = `n_pseudo` pseudo texts and initialise
   its token-embedding sequence ē_k = β·e_i + (1−β)·e_j (H_{t-1}'s token embeddings of the
   memory texts); then `gen_steps` plain SGD steps (lr `gen_lr`) on ē minimise

       L_G(k) = 1/B Σ_i max(0, s_min − s_ik) + max(0, s_ik − s_max),
       s_ik = cos(ũ'_i, g_{t-1}(ē_k)),

   where ũ'_i are H_{t-1}'s image features of **the sampled memory images** (all B of them:
   Eq. 1 averages over i for every k) and g_{t-1} is H_{t-1}'s text tower run from token
   embeddings (`encode_text_embeds`). Each ē_k has its own loss, so the SGD step is on
   Σ_k L_G(k) (the step size of one pseudo text does not depend on B̂).
2. **Contrastive** (Eq. 2-6): I2T over the B real texts + B̂ pseudo texts (pseudo texts are
   negatives only), T2I over the B real texts; L_c = α·L_c^I2T + (1−α)·L_c^T2I, with CLIP's
   learned temperature τ.
3. **Distillation** (Eq. 7-9): per-row KL between the current model's I2T (over B + B̂ texts)
   and T2I (over B images) distributions at τ and the old model's at τ_old;
   L_d = η·L_d^I2T + (1−η)·L_d^T2I. Total L_c + λ·L_d.
4. **Weight-norm clipping** (end of §3.3), after every optimizer step: any weight whose norm
   exceeds γ·‖W‖_init is rescaled to γ·‖W‖_init (direction kept).

Choices, where the paper is silent, ambiguous, or METHODS.md reads differently:

- KL direction: Eq. 7/8 write KL(P_new ‖ P_old) (current model first); METHODS.md says
  "KL of the new model's distributions against the old model's", which is usually read as
  KL(P_old ‖ P_new). The paper's formula is the default (`kd_direction=new_old`);
  `kd_direction=old_new` gives the usual teacher-first KL. Rows are averaged (1/B Σ).
- ‖W‖_init: the paper's "initial weight norm" is taken as the norms of the run's *initial*
  weights (what `runs/RUN/init/` holds: random init or the pretrained file), fixed for the
  whole stream — not the norms at each task's start, which would let the norms compound task
  after task, the growth the trick is meant to stop. Measured once in `setup()` and kept in
  the method state. "Layer weight" = every parameter with ≥ 2 dimensions (linear, conv,
  attention, embedding and projection matrices); biases, norm gains and the logit scale are
  not clipped; weights initialised to zero are skipped. Clipping runs on every task,
  including the first (which otherwise trains with L_c only: no memory, no old model).
- Unspecified values (chosen here, exposed): s_min = 0.2, s_max = 0.4 (hard negatives: below
  the cosine of a matched pair, above unrelated pairs; a tiny CLIP after one synthetic task
  has matched ≈ 0.72, unmatched 0.05 ± 0.31), γ = 1.5, 5 SGD steps with lr 0.1. The step
  size acts on token embeddings (norm ≈ 0.16 per token in the tiny model, ≈ 0.02·√width at
  open_clip's init): on that model lr 0.1 moves them by ~15 % and halves L_G in 5 steps, lr ≥ 10
  overshoots. Check the logged `m/incclip_gen_loss` (after) against `m/incclip_gen_loss0`
  (before) when changing models. Since Eq. 1 asks one pseudo text to sit in [s_min, s_max]
  against *every* sampled image, L_G cannot reach 0 when those cosines are spread out.
- τ_old = 0.01 (paper) is 1/100, where CLIP's learned temperature ends up (its clamp) in long
  from-scratch training. When the old model's own temperature is far from it (short runs:
  ≈ 1/14 on the tiny synthetic stream) the teacher is much sharper than the student, L_d is
  large (λ·L_d ≈ 65 at the start of the second task there, vs L_c ≈ 2) and, with λ = 5, the
  new task is learned slowly. `tau_old=0` uses the old model's own learned temperature.
- Pooling position of a pseudo text: open_clip pools the text tower at the end token of the
  *token ids*; a mixture has no ids, so ē_k pools (and masks, for towers with a padding mask)
  like its dominant text (e_i if β ≥ ½ else e_j) — at β = 0 or 1 it is exactly that real
  text, as the paper notes.
- Memory features: H_{t-1} is fixed during a task and so is the memory, so H_{t-1}'s image
  features and the token ids of all memory items are computed once in `before_task` (eval
  transform, no augmentation; stored on the CPU: |M|·D floats) and the per-step mini-batch is
  drawn from them; the memory is also mixed into the task's data by the loop ("we sample a
  mini-batch … from incoming data D_t and memory M_t").
- Distributed: all random draws come from `ctx.generator` (the same on every rank). If the
  number of processes divides B̂, each rank optimises its contiguous share of the B̂ pseudo
  texts (the per-text objective makes this identical to one process) and the pseudo features
  are gathered (current model: with gradient; old model: without); otherwise every rank
  generates all B̂ (identical, slower). Real-text matrices are built over the global batch.
- Only the `clip` model (an open_clip text transformer) is supported: the pseudo texts live
  in its token-embedding space.
- Precision: the old text tower runs in the training precision (`--precision`); the cosines
  and margins of Eq. 1 in float32. Under fp16 each SGD step back-propagates at the loop's loss
  scale and unscales after, as the training step and the importance passes do (one mechanism,
  `cvl.methods.scaling`; a pass whose gradients overflow is redone at a lower scale; when
  ranks split the pseudo texts they choose that scale together). Measured on the CPU's float16
  autocast (`benchmarks/incclip_fp16.py`, random ViT-B-16, 16 pseudo texts, 256 memory
  images): 1.6 % of the gradient's entries lie in float16's subnormal range, and its error
  against float32 is 3.6e-3 unscaled, 1.6e-3 scaled. Each try reads one flag from the device
  (fp16 only).

Cost (task t > 0, per optimizer step): `gen_steps` forward+backward passes and one forward
of the old text tower over the `n_pseudo` pseudo texts, plus one forward+backward of the
current text tower over them in the loss; the image side is unchanged. What keeps it down
without changing the maths:

- only the positions up to the last end token of the step's pseudo texts are run
  (`pooled_length`): with open_clip's causal mask the pooled feature never sees later
  positions, and their gradient is exactly zero (measured on the tiny model, 32-token context,
  synthetic captions of 3-6 words: see `benchmarks/README.md`; with 77-token contexts and
  ~15-token captions the saving is larger);
- generation runs once per optimizer step, so `--grad-accum k` shares it among k micro-batches
  (the pseudo texts are a per-step quantity of the method);
- with N processes (N dividing `n_pseudo`) each rank generates n_pseudo / N texts;
- the generation loss statistics stay on the device (no host sync).

The knobs, each linear in the generation cost: `n_pseudo` (B̂; the paper's 256 is 4× the
real batch of the tiny recipes), `gen_steps` (5: 6 passes), and the caption length of the
memory. `gen_images` only sizes the [B̂, B] cosine matrix of Eq. 1 (cheap).

Logged terms: `contrastive` (L_c), `kd` (λ·L_d); metrics `incclip_gen_loss0` /
`incclip_gen_loss` (mean L_G before / after the SGD steps) and `incclip_pseudo_cos` (mean
s_ik after generation).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.checks import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT
from cvl.device import to_device
from cvl.dist import gather_no_grad, gather_with_grad, rank, world_size
from cvl.errors import CvlError
from cvl.losses import global_logits
from cvl.methods.base import PreviousModelMethod, TaskContext, step_autocast
from cvl.methods.registry import register
from cvl.methods.scaling import loop_scaler, scaled_grads
from cvl.models.text_embeds import (  # noqa: F401 (re-exported: tests)
    _text_tower,
    encode_text_embeds,
    pooled_length,
    token_embedding,
)
from cvl.train.accum import loss_batch
from cvl.train.fsdp import gathered, local, plain, tensor_norms


def margin_loss(s: torch.Tensor, s_min: float, s_max: float) -> torch.Tensor:
    """Eq. 1 per pseudo text: s [K, B] cosines (pseudo text k vs image i) -> [K] (mean over i)."""
    return (F.relu(s_min - s) + F.relu(s - s_max)).mean(dim=-1)


@torch.no_grad()
def _init_pseudo(
    emb: nn.Embedding, tokens: torch.Tensor, i: torch.Tensor, j: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ē_k = β·e_i + (1−β)·e_j and the token ids that decide its pooling (dominant text)."""
    b = beta.to(tokens.device, emb.weight.dtype)[:, None, None]
    e = b * emb(tokens[i]) + (1 - b) * emb(tokens[j])
    struct = torch.where(beta.to(tokens.device)[:, None] >= 0.5, tokens[i], tokens[j])
    return e.float(), struct


def margin_forward(
    old: Any, e: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor, s_min: float, s_max: float
) -> dict[str, torch.Tensor]:
    """Eq. 1 for token embeddings `e` [K, n, W] (pooled like `tokens` [K, n]) against the
    normalised image features `u` [B, D]: the old model's features `v` [K, D], cosines `s`
    [K, B], per-text losses `lg` [K]. The tower runs under the caller's autocast; the cosines
    and margins in float32 (under fp16 a sum of K losses would round, or overflow once
    multiplied by a loss scale)."""
    v = encode_text_embeds(old, e, tokens, length=e.shape[1]).float()
    with torch.autocast(v.device.type, enabled=False):
        s = v @ u.float().t()
        return {"v": v, "s": s, "lg": margin_loss(s, s_min, s_max)}


def _grads_wrt(x: torch.Tensor, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, x))


def margin_gradient(
    old: Any,
    e: torch.Tensor,
    tokens: torch.Tensor,
    u: torch.Tensor,
    s_min: float,
    s_max: float,
    scaler: Any = None,
    agree: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """∂ Σ_k L_G(k) / ∂e (one SGD step's gradient; each text's loss is its own) and the
    forward's `margin_forward` values. `scaler` (fp16: the loop's GradScaler,
    `cvl.methods.scaling.loop_scaler`): back-propagated at the loop's loss scale and
    unscaled, as the training step's gradients; `agree`: ranks generating different texts
    choose that scale together (`scaled_grads`)."""
    x = e.detach().requires_grad_(True)
    fwd: dict[str, torch.Tensor] = {}

    def loss_of() -> torch.Tensor:
        fwd.update(margin_forward(old, x, tokens, u, s_min, s_max))
        return fwd["lg"].sum()

    with torch.enable_grad():
        (g,) = scaled_grads(loss_of, partial(_grads_wrt, x), scaler, agree)
    return g, fwd


def generate_pseudo(
    old: Any,
    tokens: torch.Tensor,
    image_features: torch.Tensor,
    i: torch.Tensor,
    j: torch.Tensor,
    beta: torch.Tensor,
    steps: int,
    lr: float,
    s_min: float,
    s_max: float,
    length: int | None = None,
    scaler: Any = None,
    agree: bool = False,
) -> dict[str, torch.Tensor]:
    """Pseudo negative texts by SGD in the old model's token-embedding space (§3.2).

    `tokens` [B, L] / `image_features` [B, D] (normalised): the sampled memory pairs;
    `i`, `j`, `beta` [K]: the mixtures. Returns embeds [K, L, W] (detached), tokens [K, L]
    (pooling), length (positions up to the last pooled one: the only ones optimised and
    encoded, see `pooled_length`; the rest keep their initial values), old_features [K, D]
    (the old model's features of the final embeddings) and the mean L_G before / after
    (`loss0`, `loss`) and the final mean cosine (`cos`). `length`: `pooled_length` of the
    mixtures' token ids when the caller knows it (from CPU copies: no host sync); else it is
    computed here (one host sync on a GPU). `scaler`, `agree`: fp16's loss scaling of each
    SGD step (`margin_gradient`).
    """
    e_full, struct = _init_pseudo(token_embedding(old), tokens, i, j, beta)
    n = (length if length is not None else pooled_length(old, struct)) or struct.shape[1]
    e = e_full[:, :n].clone()  # later positions: no effect on the features, zero gradient
    u = image_features.detach().float()
    pooled = struct[:, :n]
    loss0 = None
    for _ in range(steps):
        g, fwd = margin_gradient(old, e, pooled, u, s_min, s_max, scaler, agree)
        if loss0 is None:
            loss0 = fwd["lg"].detach().mean()
        e = (e - lr * g).detach()
    with torch.no_grad():
        fwd = margin_forward(old, e, pooled, u, s_min, s_max)
    return {
        "embeds": torch.cat([e, e_full[:, n:]], dim=1),
        "tokens": struct,
        "length": n,
        "old_features": fwd["v"].detach(),
        "loss0": fwd["lg"].mean() if loss0 is None else loss0,
        "loss": fwd["lg"].detach().mean(),
        "cos": fwd["s"].detach().mean(),
    }


def pseudo_contrastive(
    image: torch.Tensor,
    text: torch.Tensor,
    pseudo: torch.Tensor | None,
    scale: torch.Tensor | float,
    alpha: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L_c = α·CE(I2T over real + pseudo texts) + (1−α)·CE(T2I over real images) (Eq. 4-6).

    `image`/`text`: this rank's rows (normalised); real columns are the global batch;
    `pseudo` [K, D]: all pseudo-text features (already global), negatives of every image only.
    Returns (L_c, {"i2t": [b, B+K] logits, "t2i": [b, B], "targets"}).
    """
    i2t, t2i, y = global_logits(image, text, scale)
    if pseudo is not None and pseudo.shape[0] > 0:
        i2t = torch.cat([i2t, scale * image @ pseudo.t()], dim=1)
    loss = alpha * F.cross_entropy(i2t, y) + (1 - alpha) * F.cross_entropy(t2i, y)
    return loss, {"i2t": i2t, "t2i": t2i, "targets": y}


def kd_rows(
    new_logits: torch.Tensor, old_logits: torch.Tensor, direction: str = "new_old"
) -> torch.Tensor:
    """Mean over rows of KL(P_new ‖ P_old) (Eq. 7, `new_old`) or KL(P_old ‖ P_new) (`old_new`).

    P = row-softmax of the given logits (new: s·scale, old: s/τ_old); the old side has no
    gradient.
    """
    ln = F.log_softmax(new_logits, dim=-1)
    lo = F.log_softmax(old_logits.detach(), dim=-1)
    if direction == "new_old":
        kl = (ln.exp() * (ln - lo)).sum(-1)
    else:
        kl = (lo.exp() * (lo - ln)).sum(-1)
    return kl.mean()


@torch.no_grad()
def clip_weight_norms_(
    params: list[torch.Tensor], init_norms: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Rescale in place every tensor whose norm exceeds γ·init_norm to exactly that norm.

    Returns the bool mask of the tensors that were rescaled (on their device).
    """
    if not params:
        return torch.zeros(0, dtype=torch.bool)
    norms = tensor_norms(params)  # --fsdp: of the whole tensors (one all-reduce)
    limit = gamma * to_device(init_norms, norms.device).float()
    over = norms > limit
    # every tensor is multiplied, the others by exactly 1 (bitwise unchanged): choosing the
    # rescaled ones on the host would wait for the GPU every step
    factors = torch.where(over, limit / norms.clamp_min(1e-12), torch.ones_like(norms))
    shards = [local(p) for p in params]
    torch._foreach_mul_(shards, [f.to(p.dtype) for f, p in zip(factors.unbind(), shards)])
    return over


# -- the method ----------------------------------------------------------------------------------


@register("incclip")
class IncCLIP(PreviousModelMethod):
    """IncCLIP: pseudo negative texts from memory + I2T/T2I distillation + weight-norm clipping.

    Needs `--buffer reservoir --buffer-size N` (paper: 10 % of the data). Per step, n_pseudo
    token-embedding mixtures of memory texts are optimised (gen_steps × SGD, gen_lr) against
    the old model into the cosine band [s_min, s_max] of the sampled memory images; they are
    I2T negatives only. L_c = α·I2T + (1−α)·T2I; λ·(η·KD_I2T + (1−η)·KD_T2I) with the old model
    at τ_old (KL(new‖old) as in Eq. 7; kd_direction=old_new flips it); weights clipped to
    γ·(their norm in the run's initial weights) after each step. See `cvl/methods/incclip.py`.
    """

    needs_buffer = True
    itc_only = True  # its own contrastive objective: no --base-loss class-ce
    defaults = {
        "n_pseudo": 256,  # B̂ (paper: B_aug = 256)
        "gen_images": 0,  # memory pairs per step for Eq. 1 (0: the global batch size B)
        "gen_steps": 5,
        "gen_lr": 0.1,
        "s_min": 0.2,
        "s_max": 0.4,
        "alpha": 0.5,
        "eta": 0.5,
        "lambda": 5.0,
        "tau_old": 0.01,  # 0: the old model's own learned temperature
        "gamma": 1.5,  # weight-norm clipping at γ·‖W‖_init (0 = off)
        "kd_direction": "new_old",
    }
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {
        "n_pseudo": NON_NEGATIVE_INT,
        "gen_images": NON_NEGATIVE_INT,
        "gen_steps": NON_NEGATIVE_INT,
        "gen_lr": NON_NEGATIVE_FLOAT,
        "tau_old": NON_NEGATIVE_FLOAT,
        "gamma": NON_NEGATIVE_FLOAT,
    }

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        a = self.args
        self.check_choice("kd_direction", ("new_old", "old_new"))
        if a["s_min"] > a["s_max"]:
            raise CvlError(f"method 'incclip': s_min {a['s_min']} > s_max {a['s_max']}")
        if a["tau_old"] < 0:
            raise CvlError(f"method 'incclip': tau_old must be ≥ 0 (got {a['tau_old']})")
        for k in ("n_pseudo", "gen_images", "gen_steps"):
            if a[k] < 0:
                raise CvlError(f"method 'incclip': {k} must be ≥ 0 (got {a[k]})")
        self.mem_tokens: torch.Tensor | None = None  # [M, L] token ids of the memory texts
        self.mem_features: torch.Tensor | None = None  # [M, D] old image features (CPU)
        self.pseudo: dict[str, torch.Tensor] | None = None
        self.norm_names: list[str] = []
        self.init_norms: torch.Tensor | None = None

    # -- run / task -------------------------------------------------------------------------
    def setup(self, ctx: TaskContext) -> None:
        _text_tower(getattr(ctx.model, "clip", ctx.model))  # clear error for unsupported models
        if self.init_norms is None:  # the model holds the run's initial weights here
            named = self._clipped(ctx.model)
            with torch.no_grad():  # (--fsdp: `plain` reduces a norm over the shards)
                norms = [float(plain(p.detach().float().norm())) for _, p in named]
            keep = [k for k, n in enumerate(norms) if n > 0]  # zero-init weights: never clipped
            self.norm_names = [named[k][0] for k in keep]
            self.init_norms = torch.tensor([norms[k] for k in keep], dtype=torch.float64)

    @staticmethod
    def _clipped(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]

    def before_task(self, ctx: TaskContext) -> None:
        super().before_task(ctx)  # self.old: frozen previous-task model (None on task 0)
        self.mem_tokens = self.mem_features = None
        self.pseudo = None
        if self.old is not None and self.args["n_pseudo"] > 0 and ctx.buffer is not None:
            self._embed_memory(ctx)

    @torch.no_grad()
    def _embed_memory(self, ctx: TaskContext) -> None:
        """Old-model image features and token ids of every memory item (sharded + gathered)."""
        from cvl.data.reader import PairDataset, eval_loader
        from cvl.data.transforms import image_transform
        from cvl.evaluation.embed import _gather_rows

        entries = ctx.buffer.entries()
        if not entries:
            return
        old, acc = self.old, ctx.accelerator
        ds = PairDataset(entries, image_transform(old.image_size, train=False), old.tokenizer)
        feats, toks = [], []
        with gathered(old):  # --fsdp: ranks may embed different numbers of batches
            for b in eval_loader(ds, 256, rank=acc.process_index, world=acc.num_processes):
                feats.append(old.encode_image(b["image"].to(acc.device)).float())
                toks.append(b["text"].to(acc.device))
        dev, cl = acc.device, old.context_length
        f = torch.cat(feats) if feats else torch.zeros(0, old.embed_dim, device=dev)
        t = torch.cat(toks) if toks else torch.zeros(0, cl, dtype=torch.long, device=dev)
        self.mem_features = _gather_rows(f, acc, len(ds)).cpu()
        self.mem_tokens = _gather_rows(t, acc, len(ds)).cpu()

    # -- steps ------------------------------------------------------------------------------
    def before_step(self, ctx: TaskContext) -> None:
        self.pseudo = None
        a = self.args
        if self.old is None or self.mem_tokens is None or a["n_pseudo"] == 0:
            return
        g = ctx.generator
        n_mem = self.mem_tokens.shape[0]
        gb = loss_batch(ctx.config, ctx.accelerator.num_processes)  # cached accumulation: K·B·P
        nb = min(n_mem, a["gen_images"] or gb)
        k = a["n_pseudo"]
        idx = torch.randperm(n_mem, generator=g)[:nb]  # the memory mini-batch
        i = torch.randint(nb, (k,), generator=g)
        j = torch.randint(nb, (k,), generator=g)
        beta = torch.rand(k, generator=g)
        w = world_size()
        split = w > 1 and k % w == 0
        if split:  # this rank's contiguous share of the pseudo texts
            per = k // w
            mine = slice(rank() * per, (rank() + 1) * per)
            i, j, beta = i[mine], j[mine], beta[mine]
        tokens = self.mem_tokens[idx]
        # the positions to run, from the CPU copies of the mixtures' token ids (no host sync)
        length = pooled_length(self.old, torch.where(beta[:, None] >= 0.5, tokens[i], tokens[j]))
        dev = ctx.device
        # the old model runs in the training precision; --fsdp: whole while it generates (the
        # text pass reads its embeddings directly and back-propagates to the pseudo texts)
        with step_autocast(ctx), gathered(self.old):
            out = generate_pseudo(
                self.old,
                to_device(tokens, dev),
                to_device(self.mem_features[idx], dev),
                to_device(i, dev),
                to_device(j, dev),
                to_device(beta, dev),
                a["gen_steps"],
                a["gen_lr"],
                a["s_min"],
                a["s_max"],
                length=length,
                scaler=loop_scaler(ctx),  # fp16: the training step's loss scale
                agree=split,
            )
        out["split"] = split
        self.pseudo = out

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        a = self.args
        v, w, scale = out["image_features"], out["text_features"], out["logit_scale"]
        ps = self.pseudo
        pseudo = old_pseudo = None
        if ps is not None:
            pseudo = encode_text_embeds(
                ctx.model, ps["embeds"], ps["tokens"], length=ps.get("length")
            )
            old_pseudo = ps["old_features"]
            if ps["split"]:
                pseudo, old_pseudo = gather_with_grad(pseudo), gather_no_grad(old_pseudo)
            ctx.metrics["incclip_gen_loss0"] = ps["loss0"]  # tensors: no host sync per step
            ctx.metrics["incclip_gen_loss"] = ps["loss"]
            ctx.metrics["incclip_pseudo_cos"] = ps["cos"]
        lc, m = pseudo_contrastive(v, w, pseudo, scale, a["alpha"])
        terms = {"contrastive": lc}
        if self.old is None:
            return terms
        ov, ow = (f.float() for f in self.old_features(batch))
        with torch.no_grad():
            # 1/τ_old; tau_old=0: the old model's own learned temperature
            old_scale = 1.0 / a["tau_old"] if a["tau_old"] > 0 else self.old.logit_scale()
            old_i2t, old_t2i, _ = global_logits(ov, ow, old_scale)
            if old_pseudo is not None and old_pseudo.shape[0] > 0:
                old_i2t = torch.cat([old_i2t, old_scale * ov @ old_pseudo.float().t()], 1)
        d = a["kd_direction"]
        ld = a["eta"] * kd_rows(m["i2t"], old_i2t, d) + (1 - a["eta"]) * kd_rows(
            m["t2i"], old_t2i, d
        )
        terms["kd"] = a["lambda"] * ld
        return terms

    def after_step(self, ctx: TaskContext) -> None:
        if self.args["gamma"] <= 0 or self.init_norms is None:
            return
        params = dict(ctx.model.named_parameters())
        clip_weight_norms_(
            [params[n] for n in self.norm_names], self.init_norms, self.args["gamma"]
        )

    def after_task(self, ctx: TaskContext) -> None:
        self.pseudo = None
        self.mem_tokens = self.mem_features = None

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.init_norms is None:
            return {}
        return {"init_norm_names": list(self.norm_names), "init_norms": self.init_norms}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "init_norms" in state:
            self.norm_names = list(state["init_norm_names"])
            self.init_norms = state["init_norms"].to(torch.float64)
