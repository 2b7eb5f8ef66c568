"""GeoDL: geodesic distillation (Simon, Koniusz & Harandi, CVPR 2021), as IncCLIP adapts it
("we replace the cross entropy loss with contrastive loss", IncCLIP §4).

On each batch of task t > 0, the previous task's model (old, frozen) and the training model
embed the **global** batch. Each model's embeddings span a k-dimensional subspace (top-k right
singular vectors of the N × d feature matrix): P_old, P_new (d × k, orthonormal). The geodesic
flow Φ(ν), ν ∈ [0, 1], on the Grassmannian joins them; with the principal angles θ and vectors
(P_oldᵀP_new = U cos Θ Vᵀ, A = P_old U, B = (A cos Θ − P_new V)/sin Θ) it is
Φ(ν) = A cos(νΘ) − B sin(νΘ), and the flow kernel is (closed form of the integral)::

    Q = ∫₀¹ Φ(ν)Φ(ν)ᵀ dν = A Λ₁ Aᵀ − A Λ₂ Bᵀ − B Λ₂ Aᵀ + B Λ₃ Bᵀ
    λ₁ = ½(1 + sin 2θ / 2θ),   λ₂ = sin²θ / 2θ,   λ₃ = ½(1 − sin 2θ / 2θ)

The distillation compares each item's old and new embedding in the metric of Q (GeoDL Eq. 9)::

    L_geo = mean_i [1 − z'_iᵀ Q z_i / (‖z'_i‖_Q ‖z_i‖_Q)]

for the image and the text embeddings (averaged). Total: base loss + λ·L_geo; task 0: base
loss. Choices (the papers give none for VL): the subspaces come from the L2-normalised
embeddings of the global batch; k = `dim` (0: half the embedding width, at most N − 1);
Q carries no gradient (the SVDs are not differentiated; the gradient flows through z_i in the
similarity); λ = `weight` = 1. Logged: `itc`, `geodl` (+ `mlm`). On a GPU the four SVDs per
step make the host wait for the device (torch checks cuSOLVER's convergence flag): GeoDL's
one unavoidable host sync per step; the rest of its step makes none.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.checks import NON_NEGATIVE_INT
from cvl.dist import gather_no_grad
from cvl.methods.base import PreviousModelMethod, TaskContext, base_loss
from cvl.methods.registry import register


def subspace(x: torch.Tensor, k: int) -> torch.Tensor:
    """Orthonormal basis (d × k) of the top-k right singular vectors of x (N × d)."""
    return torch.linalg.svd(x.double(), full_matrices=False)[2][:k].t()


def flow_kernel(p1: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
    """Q = ∫₀¹ Φ(ν)Φ(ν)ᵀ dν for the geodesic from span(p1) to span(p2) (d × k bases)."""
    u, cos, vh = torch.linalg.svd(p1.t() @ p2)
    cos = cos.clamp(-1.0, 1.0)
    theta = torch.arccos(cos)
    sin = torch.sin(theta)
    a = p1 @ u
    moving = sin > 1e-7
    b = torch.where(moving, (a * cos - p2 @ vh.t()) / torch.where(moving, sin, 1.0), 0.0)
    sinc2 = torch.sinc(2 * theta / torch.pi)  # sin 2θ / 2θ (1 at θ = 0)
    l1 = 0.5 * (1 + sinc2)
    l2 = torch.where(moving, sin**2 / (2 * torch.where(moving, theta, 1.0)), 0.0)
    l3 = 0.5 * (1 - sinc2)
    cross = (a * l2) @ b.t()
    return (a * l1) @ a.t() - cross - cross.t() + (b * l3) @ b.t()


def geodesic_distance(new: torch.Tensor, old: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """mean_i 1 − cos_Q(old_i, new_i) for this rank's rows (rank mean = global mean)."""
    q = q.to(new.dtype)
    old = old.detach().to(new.dtype)
    num = (old @ q * new).sum(-1)
    n_old = (old @ q * old).sum(-1).clamp(min=1e-12).sqrt()
    n_new = (new @ q * new).sum(-1).clamp(min=1e-12).sqrt()
    return (1 - num / (n_old * n_new)).mean()


def geodl_term(new: torch.Tensor, old: torch.Tensor, k: int) -> torch.Tensor:
    """L_geo for one modality; subspaces from the gathered global batch (no gradient)."""
    with torch.no_grad():
        all_new, all_old = gather_no_grad(new.detach()), gather_no_grad(old)
        k = k or new.shape[1] // 2
        k = max(1, min(k, all_new.shape[0] - 1, new.shape[1]))
        q = flow_kernel(subspace(all_old, k), subspace(all_new, k))
    return geodesic_distance(new, old, q)


@register("geodl")
class GeoDL(PreviousModelMethod):
    """GeoDL: old/new embeddings compared in the geodesic-flow metric between their subspaces."""

    defaults = {"weight": 1.0, "dim": 0}
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {"dim": NON_NEGATIVE_INT}

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = base_loss(ctx.model, batch, out, ctx)
        if self.old is None:
            return terms
        ov, ow = self.old_features(batch)
        k = self.args["dim"]
        geo = geodl_term(out["image_features"], ov, k) + geodl_term(out["text_features"], ow, k)
        terms["geodl"] = self.args["weight"] * geo / 2
        return terms
