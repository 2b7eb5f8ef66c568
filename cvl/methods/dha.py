"""DHA: dynamic historical adaptation (CITM paper, §3.3, Eq. 7-10, Alg. 1).

Two sets of weights: the main model θ_M (the model the loop trains) and a historical copy
θ_H. At the start of task t > 0 both are the previous task's model. At iteration i = 1, 2, …
of the task (i = `ctx.step + 1`), before the forward pass::

    θ_M^{i,pre} = λ1·θ_M^{i-1} + (1−λ1)·θ_H^{i-1}                        (Eq. 7)
    θ_M^i       = θ_M^{i,pre} − η·∇L_c(θ_M^{i,pre})   (the loop's optimizer step, Eq. 8)
    θ_H^i       = λ2·θ_H^{i-1} + (1−λ2)·θ_M^{i-1}   if i % k == 0, else θ_H^{i-1}   (Eq. 10)

Both updates read the weights at the end of iteration i−1: Alg. 1 writes the θ_H update
first, but in terms of θ_M^{i-1} (the main weights before this iteration's blend and step),
and Eq. 9 blends θ_M with θ_H^{i-1} (the historical weights before this iteration's update).
So on an update iteration both are computed from D = θ_H^{i-1} − θ_M^{i-1}:
θ_M += (1−λ1)·D, θ_H −= (1−λ2)·D — two `torch._foreach_*` passes over the parameters (one
`_foreach_lerp_` on the other iterations), no Python loop per tensor.

Choices, where the paper is silent or the toolkit differs:

- Start point and result of a task: the paper's "best main model found in task T_{t-1}
  (according to the validation performance on task T_{t-1})" initialises both models of the
  next task (Fig. 3, §3.3) and is what Alg. 1 returns. DHA sets `selects_best_val`, so with
  the default `--select auto` the loop scores the main model on the task's `val` pairs after
  every epoch and ends the task with the best epoch's weights (`cvl.train.selection`; saved
  as the task checkpoint, so evaluation sees it too). Streams without `val` pairs fall back
  to the last iteration's model (said in the log); `--select last` forces that. (Table 9
  compares best-val vs last-iteration initialisation of the *historical* model only and finds
  them "almost the same".)
- First task: Alg. 1 trains θ_main on D_1 plainly ("initialize θ_main by training the main
  model on D_1"): no historical model, no blending, base loss only.
- What is blended: every floating-point `nn.Parameter` of the model (the paper's "total
  parameters"). BatchNorm running statistics are buffers, not parameters: they are not
  blended and follow the main model's forward passes.
- Loss: L_c = L_i2t + L_t2i (Eq. 5), the *sum* of the two InfoNCE directions over the
  global batch, i.e. 2 × `clip_loss` (which averages them); `sum_directions=false` gives the
  average. With Adam(W) the factor mostly cancels (it matters for gradient clipping and ε).
  The fusion model adds its MLM term as in the base loss.
- Replay: "DHA" in the paper uses a ring buffer of 5 % of each task's training set
  (`--buffer ring --buffer-size N`, N ≈ 5 % of a task); "DHA†" is the same without a buffer.
  Buffer items are mixed into the task's data by the loop.
- θ_H lives on the model's device (one extra copy of the weights) and is saved in the
  method state while a task runs (exact mid-task resume); it is dropped after the task.

Defaults (paper §4.2 / Table 5): λ1 = 0.995, λ2 = 0.985, k = 5. Logged term: `contrastive`
(+ `mlm` for the fusion model).
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.checks import POSITIVE_INT, Num
from cvl.errors import CvlError
from cvl.methods.base import Method, TaskContext, base_loss, state_mismatch
from cvl.methods.registry import register


@torch.no_grad()
def dha_blend(
    main: list[torch.Tensor],
    hist: list[torch.Tensor],
    lambda1: float,
    lambda2: float,
    update_hist: bool,
) -> None:
    """One iteration's parameter transfer, in place (Eq. 7, and Eq. 10 when `update_hist`).

    main ← λ1·main + (1−λ1)·hist; if `update_hist`: hist ← λ2·hist + (1−λ2)·main, both from
    the values *before* the call (simultaneous update).
    """
    if update_hist:
        d = torch._foreach_sub(hist, main)  # θ_H^{i-1} − θ_M^{i-1}
        torch._foreach_add_(main, d, alpha=1.0 - lambda1)
        torch._foreach_add_(hist, d, alpha=-(1.0 - lambda2))
    else:
        torch._foreach_lerp_(main, hist, 1.0 - lambda1)


@register("dha")
class DHA(Method):
    """DHA: main ⇄ historical parameter transfer (λ1 each step, λ2 every k steps); + ring = DHA.

    Before each step θ_M ← λ1·θ_M + (1−λ1)·θ_H; every k steps θ_H ← λ2·θ_H + (1−λ2)·θ_M, both
    from the previous iteration's weights; loss L_i2t + L_t2i. Task 0 trains plainly (Alg. 1).
    DHA = `--buffer ring --buffer-size` ≈ 5 % of a task; DHA† = no buffer. Each task ends with
    its best epoch on the stream's val pairs (when present), which starts the next task.
    """

    defaults = {"lambda1": 0.995, "lambda2": 0.985, "k": 5, "sum_directions": True}
    #: bounds of the arguments (cvl.checks): refused in one line before anything runs
    limits = {"lambda1": Num(float, 0, 1), "lambda2": Num(float, 0, 1), "k": POSITIVE_INT}
    selects_best_val = True  # `--select auto`: end each task with the best epoch on val

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        a = self.args
        for name in ("lambda1", "lambda2"):
            if not 0.0 <= a[name] <= 1.0:
                raise CvlError(f"method 'dha': {name} must be in [0, 1] (got {a[name]})")
        if a["k"] < 1:
            raise CvlError(f"method 'dha': k must be ≥ 1 (got {a['k']})")
        self.names: list[str] = []
        self.hist: list[torch.Tensor] | None = None

    def before_task(self, ctx: TaskContext) -> None:
        self.hist = None
        if ctx.first_task:  # Alg. 1: task 1 is plain training of the main model
            return
        named = self._named(ctx)
        self.names = [n for n, _ in named]
        # θ_H^0 = θ_M^0 = the previous task's (final) model, which the model holds now
        self.hist = [p.detach().clone() for _, p in named]

    @staticmethod
    def _named(ctx: TaskContext) -> list[tuple[str, torch.nn.Parameter]]:
        # what trains (all of it under --tune full; the adapters under --tune lora/dora)
        return [
            (n, p)
            for n, p in ctx.model.named_parameters()
            if p.is_floating_point() and p.requires_grad
        ]

    def before_step(self, ctx: TaskContext) -> None:
        if self.hist is None:
            return
        a = self.args
        i = ctx.step + 1  # iterations are counted from 1 within the task (Alg. 1)
        main = [p for _, p in self._named(ctx)]  # collected each step: cheap, never stale
        dha_blend(main, self.hist, a["lambda1"], a["lambda2"], i % a["k"] == 0)

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = base_loss(ctx.model, batch, out, ctx)
        if "itc" not in terms:  # --base-loss class-ce: no directions to sum
            return terms
        itc = terms.pop("itc")
        if self.args["sum_directions"]:
            itc = 2.0 * itc  # clip_loss averages the two directions; Eq. 5 sums them
        return {"contrastive": itc, **terms}

    def after_task(self, ctx: TaskContext) -> None:
        self.hist = None

    def state_dict(self) -> dict[str, Any]:
        if self.hist is None:
            return {}
        return {"hist": dict(zip(self.names, self.hist))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("hist")
        if not saved:
            return
        if self.hist is None:
            raise CvlError("method 'dha': a historical model can only be loaded inside a task")
        if set(saved) != set(self.names):
            raise CvlError(state_mismatch("dha", "hist", saved, self.names))
        with torch.no_grad():
            for n, h in zip(self.names, self.hist):
                h.copy_(saved[n])
