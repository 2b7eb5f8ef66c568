"""CTP: compatible momentum contrast with topology preservation (CTP paper §4, Alg. 1; CTP code).

Three models: the training model F (`ctx.model`), a compatible momentum model M (owned here)
and the reference R = the previous task's final model (`ctx.previous_model()`, frozen, rebuilt
from disk in `before_task`; absent on the first task). v, w = L2-normalised image / text
features; B = global batch; rows are this rank's items, columns the whole global batch.

Compatible momentum update (Eq. 3), once per optimizer step, with `torch._foreach_*`:

    t > 0:  θ_M ← m·θ_M + (1−m)/2·θ_F + (1−m)/2·θ_R        m = `momentum` = 0.9
    t = 0:  θ_M ← m0·θ_M + (1−m0)·θ_F                       m0 = `first_momentum` = 0.995

M is re-copied from F at the start of every task (as the code does; on t > 0 that is also R).
The code updates M inside the forward, before M's forward, with F's pre-step weights; we update
in `after_step` with F's post-step weights, which is the same sequence (M = F at task start,
so the code's first update is the identity) without an extra pass over the weights per step.
Parameters and BatchNorm running statistics are blended; M runs in eval mode (the code leaves
M in train mode, i.e. with dropout; a deterministic teacher is the cleaner reading).

Momentum contrast (Eq. 4, Alg. 1): queues Q^I, Q^T of K = `queue_size` = 1024 momentum
features persist across tasks (initialised with random unit vectors as in the code/ALBEF,
seeded by the run seed). Columns are [momentum features of the global batch; queue] (N_Q = B +
K), hard one-hot targets on the item's own momentum feature, τ = `temp` = 0.07:

    L_ita^c = ½·[CE(v·[w_M; Q^T]ᵀ/τ, y) + CE(w·[v_M; Q^I]ᵀ/τ, y)]

then the gathered momentum features of the global batch are enqueued (FIFO ring; same queue on
all ranks). The code uses each GPU's local momentum batch as positives; the global batch makes
N processes × batch B train exactly like 1 × N·B.

MLM distillation (Eq. 5, fusion model only): L_mlm^c = −T²·Σ softmax(M's MLM logits / T) ·
log_softmax(F's MLM logits / T) (Eq. 5 has no T: the default T = 1 is exactly Eq. 5), averaged over the masked positions of the global batch (each
rank scales its sum by world / global count, so uneven masking across ranks stays exact), on
the same masked ids as F's MLM loss (`mlm_term`'s masking); T = `distill_temp` = 1. The
code computes it on the first task but drops it from the loss; the paper applies L_CMC
throughout, so it is on by default (`first_task_mlm_distill=false` reproduces the code).

Topology preservation against R (Eqs. 6–9), τ = `temp`, over the global batch:

    L_c = ½·[KL(P_R^{i2t} ‖ P_F^{i2t}) + KL(P_R^{t2i} ‖ P_F^{t2i})]
    L_s = ½·[KL(P̂_R^{i2i} ‖ P̂_F^{i2i}) + KL(P̂_R^{t2t} ‖ P̂_F^{t2t})]

P = row softmax of cosine similarities / τ; P̂: the diagonal similarity set to `diag_value` =
−1000 before dividing by τ. KL summed over a row, averaged over rows (the code's `batchmean`;
each rank averages its own rows against all columns, ranks' gradients are averaged).
The reference is the target. The paper writes the cross-entropy H(P_R, P_F) (Eqs. 7, 9); the
code uses KL: they differ by the entropy of the (constant) target, so gradients are identical;
we log the KL (0 when the topology is kept). Eq. 7's first term prints P^{t2t}_{θ_t} as the
target, a typo for P^{i2t}_{θ_{t−1}} (code). The ½ factors follow Eqs. 7/9 and the code (Alg.
1 omits them). Absent on the first task (no R), said once in the log.

Total (Eq. 10): base (ITC with the model's own logit scale — fixed 1/0.07 for `fusion` as in
the code, learnable for `clip` — + MLM for fusion) + `momentum_weight`
·L_ita^c + `mlm_distill_weight`·L_mlm^c + `cross_modal_weight`·L_c + `same_modal_weight`·L_s,
weights 1. Logged terms: itc, mlm, momentum_itc, momentum_mlm, topo_cross, topo_same (with the
`clip` model the MLM terms are absent; said once). CTP+ER = `--buffer reservoir`.

Start from a trained model, as the paper does (DeiT + BERT). A *random* fusion model's [CLS]
features are nearly identical across items, and so are the momentum model's (a copy of it,
moving with time constant 1/(1−0.995) = 200 steps on the first task). Against nearly equal
positives the momentum contrast mostly rewards aligning every feature with their common
direction, and the model stays on the ITC plateau (measured on the tiny fusion model and the
synthetic stream: ITC ≈ ln B through task 0; a faster first momentum of 0.95 collapses it
fully). From a model trained on one task, CTP learns the next one and forgets less than SeqF.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cvl.checks import POSITIVE_FLOAT, POSITIVE_INT, Num
from cvl.dist import gather_no_grad, gather_with_grad, local_rows
from cvl.losses import clip_loss, global_mlm_distillation, kl_rows
from cvl.methods.base import Method, TaskContext, frozen_copy, mlm_term
from cvl.methods.registry import register
from cvl.train.accum import frozen_rows

# -- the pieces, as functions (tested one by one) -----------------------------------------------


def _blend_names(model: nn.Module) -> list[str]:
    """Parameters + BatchNorm running statistics: what the momentum update blends (names)."""
    out = [n for n, _ in model.named_parameters()]
    for mn, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            pre = f"{mn}." if mn else ""
            out += [pre + b for b in ("running_mean", "running_var") if getattr(m, b) is not None]
    return out


def _blend_tensors(model: nn.Module, names: list[str] | None = None) -> list[torch.Tensor]:
    """The tensors `_blend_names` lists (of the plain model `names` come from); a model with
    `--tune lora/dora` adapters gives its weights as they compute (by plain name)."""
    from cvl.models.tune import effective_state

    if names is not None:
        eff = effective_state(model)
        return [eff[n] for n in names]
    out = [p.data for p in model.parameters()]
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            out += [b for b in (m.running_mean, m.running_var) if b is not None]
    return out


@torch.no_grad()
def compatible_momentum_update(
    momentum: nn.Module, train: nn.Module, ref: nn.Module | None, m: float
) -> None:
    """θ_M ← m·θ_M + (1−m)/2·θ_F + (1−m)/2·θ_R; without `ref`: θ_M ← m·θ_M + (1−m)·θ_F."""
    from cvl.models.tune import has_adapters

    names = _blend_names(momentum) if has_adapters(train) else None
    tm, tf = _blend_tensors(momentum), _blend_tensors(train, names)
    torch._foreach_mul_(tm, m)
    if ref is None:
        torch._foreach_add_(tm, tf, alpha=1.0 - m)
    else:
        torch._foreach_add_(tm, tf, alpha=(1.0 - m) / 2)
        torch._foreach_add_(tm, _blend_tensors(ref), alpha=(1.0 - m) / 2)


@torch.no_grad()
def enqueue(queue: torch.Tensor, ptr: int, feats: torch.Tensor) -> int:
    """Write `feats` [n, D] into the ring `queue` [K, D] from `ptr` (wrapping); new pointer."""
    k = queue.shape[0]
    feats = feats[-k:]  # more rows than slots: only the newest K survive
    idx = (ptr + torch.arange(feats.shape[0], device=queue.device)) % k
    queue[idx] = feats.to(queue.dtype)
    return int((ptr + feats.shape[0]) % k)


def momentum_contrast(
    v: torch.Tensor,
    w: torch.Tensor,
    v_m: torch.Tensor,
    w_m: torch.Tensor,
    queue_v: torch.Tensor,
    queue_w: torch.Tensor,
    temp: float,
) -> torch.Tensor:
    """L_ita^c: this rank's v (w) against [momentum w (v) of the global batch; text (image) queue].

    `v_m`, `w_m`: momentum features of the *global* batch (gathered); hard one-hot targets.
    """
    rows = local_rows(v.shape[0])
    y = torch.arange(rows.start, rows.stop, device=v.device)
    cols_w = torch.cat([w_m.to(queue_w.dtype), queue_w]).to(v.dtype)
    cols_v = torch.cat([v_m.to(queue_v.dtype), queue_v]).to(w.dtype)
    i2t = v @ cols_w.t() / temp
    t2i = w @ cols_v.t() / temp
    return (F.cross_entropy(i2t, y) + F.cross_entropy(t2i, y)) / 2


def _mask_own(sim: torch.Tensor, value: float) -> torch.Tensor:
    """Set each local row's similarity to itself (its global column) to `value`."""
    n = sim.shape[0]
    rows = local_rows(n)
    own = torch.zeros_like(sim, dtype=torch.bool)
    own[
        torch.arange(n, device=sim.device), torch.arange(rows.start, rows.stop, device=sim.device)
    ] = True
    return sim.masked_fill(own, value)


def topology_terms(
    v: torch.Tensor,
    w: torch.Tensor,
    v_ref: torch.Tensor,
    w_ref: torch.Tensor,
    temp: float,
    diag_value: float = -1000.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_c, L_s): cross-modal and same-modal KL(reference ‖ current) over the global batch."""
    av, aw = gather_with_grad(v), gather_with_grad(w)
    rv, rw = gather_no_grad(v_ref), gather_no_grad(w_ref)
    i2t, t2i = v @ aw.t(), w @ av.t()
    i2t_r, t2i_r = v_ref @ rw.t(), w_ref @ rv.t()
    i2i, t2t = _mask_own(v @ av.t(), diag_value), _mask_own(w @ aw.t(), diag_value)
    i2i_r = _mask_own(v_ref @ rv.t(), diag_value)
    t2t_r = _mask_own(w_ref @ rw.t(), diag_value)
    cross = (kl_rows(i2t_r / temp, i2t / temp) + kl_rows(t2i_r / temp, t2i / temp)) / 2
    same = (kl_rows(i2i_r / temp, i2i / temp) + kl_rows(t2t_r / temp, t2t / temp)) / 2
    return cross, same


def _note(ctx: TaskContext, msg: str) -> None:
    if getattr(ctx.accelerator, "is_main_process", True):
        print(f"ctp: {msg}", flush=True)


# -- the method ---------------------------------------------------------------------------------


@register("ctp")
class CTP(Method):
    """CTP: compatible momentum contrast (queues, MLM distillation) + topology preservation.

    See the module docstring for the equations, defaults and paper/code choices.
    """

    itc_only = True  # its own contrastive objective: no --base-loss class-ce
    defaults = {
        "momentum": 0.9,
        "first_momentum": 0.995,
        "queue_size": 1024,
        "temp": 0.07,
        "diag_value": -1000.0,
        "distill_temp": 1.0,
        "momentum_weight": 1.0,
        "mlm_distill_weight": 1.0,
        "cross_modal_weight": 1.0,
        "same_modal_weight": 1.0,
        "first_task_mlm_distill": True,
    }
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {
        "momentum": Num(float, 0, 1),
        "first_momentum": Num(float, 0, 1),
        "queue_size": POSITIVE_INT,
        "temp": POSITIVE_FLOAT,
        "distill_temp": POSITIVE_FLOAT,
    }

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.momentum_model: nn.Module | None = None
        self.ref: nn.Module | None = None
        self.queue_v: torch.Tensor | None = None
        self.queue_w: torch.Tensor | None = None
        self.queue_ptr = 0
        self._in_task = False

    # -- hooks ----------------------------------------------------------------------------------
    def setup(self, ctx: TaskContext) -> None:
        model = ctx.model
        self.momentum_model = frozen_copy(model)
        k, d = int(self.args["queue_size"]), int(model.embed_dim)
        g = torch.Generator().manual_seed(int(getattr(ctx.config, "seed", 0)))
        self.queue_v = F.normalize(torch.randn(k, d, generator=g), dim=-1).to(ctx.device)
        self.queue_w = F.normalize(torch.randn(k, d, generator=g), dim=-1).to(ctx.device)
        self.queue_ptr = 0
        if not getattr(model, "has_fusion", False):
            _note(
                ctx,
                f"model '{model.kind}' has no fusion encoder: the MLM and MLM-distillation "
                "terms are absent (CTP's L_mlm, L_mlm^c need --model fusion)",
            )

    def before_task(self, ctx: TaskContext) -> None:
        self.ref = ctx.previous_model()
        from cvl.models.tune import effective_state

        self.momentum_model.load_state_dict(effective_state(ctx.model))  # M ← F (resume reloads)
        self.momentum_model.eval()
        self._in_task = True
        if self.ref is None:
            _note(
                ctx,
                "first task: no previous-task model, so the topology terms (topo_cross, "
                f"topo_same) are off; momentum update is EMA m={self.args['first_momentum']}",
            )

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        a, model = self.args, ctx.model
        fusion = getattr(model, "has_fusion", False)
        v, w = out["image_features"], out["text_features"]
        terms = {"itc": clip_loss(v, w, out["logit_scale"])}
        masked = None
        if fusion:
            terms["mlm"], logits, masked, labels = mlm_term(model, batch, out, ctx)
        distill_mlm = bool(
            fusion
            and a["mlm_distill_weight"]
            and (a["first_task_mlm_distill"] or self.ref is not None)
        )
        if a["momentum_weight"] or distill_mlm:
            with torch.no_grad():
                m = self.momentum_model
                if distill_mlm:
                    out_m = frozen_rows(m, batch["image"], batch["text"], mlm_ids=masked)
                else:
                    out_m = frozen_rows(m, batch["image"], batch["text"])
                v_m = gather_no_grad(out_m["image_features"].detach())
                w_m = gather_no_grad(out_m["text_features"].detach())
            if a["momentum_weight"]:
                terms["momentum_itc"] = a["momentum_weight"] * momentum_contrast(
                    v, w, v_m, w_m, self.queue_v, self.queue_w, a["temp"]
                )
            if distill_mlm:
                terms["momentum_mlm"] = a["mlm_distill_weight"] * global_mlm_distillation(
                    logits, out_m["mlm_logits"], labels, a["distill_temp"]
                )
            enqueue(self.queue_w, self.queue_ptr, w_m)
            self.queue_ptr = enqueue(self.queue_v, self.queue_ptr, v_m)
        if self.ref is not None and (a["cross_modal_weight"] or a["same_modal_weight"]):
            with torch.no_grad():
                out_r = frozen_rows(self.ref, batch["image"], batch["text"])
            cross, same = topology_terms(
                v, w, out_r["image_features"], out_r["text_features"], a["temp"], a["diag_value"]
            )
            if a["cross_modal_weight"]:
                terms["topo_cross"] = a["cross_modal_weight"] * cross
            if a["same_modal_weight"]:
                terms["topo_same"] = a["same_modal_weight"] * same
        return terms

    def after_step(self, ctx: TaskContext) -> None:
        if self.ref is None:
            compatible_momentum_update(
                self.momentum_model, ctx.model, None, self.args["first_momentum"]
            )
        else:
            compatible_momentum_update(
                self.momentum_model, ctx.model, self.ref, self.args["momentum"]
            )

    def after_task(self, ctx: TaskContext) -> None:
        self._in_task = False  # M is re-copied from F at the next task: no need to save it

    def state_dict(self) -> dict[str, Any]:
        st: dict[str, Any] = {
            "queue_image": self.queue_v,
            "queue_text": self.queue_w,
            "queue_ptr": int(self.queue_ptr),
        }
        if self._in_task:
            st["momentum_model"] = self.momentum_model.state_dict()
        return st

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self.queue_v.shape != state["queue_image"].shape:
            from cvl.errors import CvlError

            raise CvlError(
                f"ctp: saved queue has shape {tuple(state['queue_image'].shape)}, "
                f"queue_size/embed_dim give {tuple(self.queue_v.shape)}"
            )
        self.queue_v.copy_(state["queue_image"])
        self.queue_w.copy_(state["queue_text"])
        self.queue_ptr = int(state["queue_ptr"])
        if "momentum_model" in state:
            self.momentum_model.load_state_dict(state["momentum_model"])
