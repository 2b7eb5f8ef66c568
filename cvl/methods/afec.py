"""AFEC: active forgetting with an expanded model (Wang et al. 2021; CTP appendix B.1, Eq. 13;
CTP code).

EWC (F, θ*: `cvl.methods.ewc`) plus an *expanded* copy θ_e trained on the new task alone.
On task t > 0, at the start of every epoch (as the CTP code):

1. the expanded model — a copy of the model at the start of the task, continued from epoch to
   epoch with its own AdamW (same hyperparameters and cosine schedule as the main model) —
   trains one epoch on task t's own pairs with the base loss, on the same global batches as
   the main model's epoch (same seed; no replay items: AFEC is memory-free), for as many
   steps as the main model takes in that epoch;
2. its Fisher F_e of the base loss over the whole task (`ewc.task_fisher`) and its weights θ_e
   are taken;
3. the main model trains the epoch with (Eq. 13)

       L = L_base + λ/2·ΣF(θ − θ*)² + λ_e/2·ΣF_e(θ − θ_e)²,   λ = 5000, λ_e = 1 (CTP code).

Eq. 13's text calls λ_e "the FIM of θ_t*"; it is the weight of the second term and F_e the
expanded model's Fisher (Ω* in Eq. 13), as the code has it. After each task the main model's
Fisher is merged into F as in EWC (skipped after the last task). Task 0 trains plainly. The
expanded training and its Fisher pass cost about two extra epochs per epoch (CTP Table 1:
~2.5× SeqF). Its randomness is seeded from (seed, task, epoch) in a forked RNG, so the main
model's steps draw exactly what they would without it. The expanded model, its optimizer and
schedule, F_e and the epoch they belong to are in the method state (exact mid-task resume).
Logged terms: `ewc` (λ/2·ΣF(θ−θ*)²) and `afec` (λ_e/2·ΣF_e(θ−θ_e)²); metric
`afec_expanded_loss` (the expanded model's mean base loss over its last epoch).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from cvl.data.reader import sample_seed
from cvl.device import to_device
from cvl.dist import all_reduce_mean, average_gradients
from cvl.methods.base import TaskContext, base_loss
from cvl.methods.ewc import EWC, task_fisher
from cvl.methods.registry import register
from cvl.methods.regularizers import task_batches, trainable
from cvl.train.accum import FeatureCache, is_cached
from cvl.train.cost import extra
from cvl.train.fsdp import clip_grad_norm_, is_sharded, optimizer_state_in, sharded_copy


def _opt_state_in(sd: dict) -> dict:
    """An optimizer state_dict back from the JSON/safetensors round trip (int keys, tuples)."""
    state = {int(k): v for k, v in sd["state"].items()}
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


@register("afec")
class AFEC(EWC):
    """AFEC: EWC + λ_e/2·ΣF_e(θ−θ_e)² to an expanded copy trained on the task each epoch."""

    defaults = {"lam": 5000.0, "lam_e": 1.0, "fisher_batches": 0}
    term = "ewc"

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.expanded: torch.nn.Module | None = None
        self.exp_opt = self.exp_sched = None
        self.exp_epoch = -1  # the epoch whose expanded model / F_e are current
        self.fisher_e: list | None = None
        self.exp_loss = 0.0
        self._value_e: torch.Tensor | None = None
        self._pending: dict | None = None

    def before_task(self, ctx: TaskContext) -> None:
        super().before_task(ctx)
        self.expanded, self.exp_opt, self.exp_sched, self.fisher_e = None, None, None, None
        self.exp_epoch, self._pending = -1, None
        if not ctx.first_task:
            # θ at the task's start (= θ*); --fsdp: sharded on the model's plan
            sharded = is_sharded(ctx.model)
            model = ctx.model
            self.expanded = sharded_copy(model, trainable=True) if sharded else copy.deepcopy(model)
            self.expanded.train()

    def _ensure_optimizer(self, ctx: TaskContext) -> None:
        """The expanded model's AdamW + schedule (needs `ctx.steps_in_task`, known from the
        first step on); a state loaded on resume is applied here."""
        if self.exp_opt is None:
            from cvl.train.optim import optimizer_with_schedule  # built like the loop's optimizer

            params = [p for _, p in trainable(self.expanded)]
            self.exp_opt, self.exp_sched = optimizer_with_schedule(
                params, ctx.config, ctx.steps_in_task, ctx.lr_lambda, ctx.task_name
            )
            if self._pending is not None:
                sd = _opt_state_in(self._pending["optimizer"])
                if is_sharded(self.expanded):  # whole moments on disk: this rank's slices
                    sd = optimizer_state_in(self.exp_opt, sd)
                self.exp_opt.load_state_dict(sd)
                self.exp_sched.load_state_dict(self._pending["scheduler"])
                self._pending = None

    def _expanded_epoch(self, ctx: TaskContext) -> None:
        """Train the expanded model one epoch, then take its Fisher (steps 1–2 above)."""
        cfg, model = ctx.config, self.expanded
        self._ensure_optimizer(ctx)
        params = [p for _, p in trainable(model)]
        accum = max(1, int(cfg.grad_accum))
        gb = cfg.batch_size * (ctx.accelerator.num_processes if ctx.accelerator else 1)
        n_batches = max(1, len(ctx.task_entries) // gb)
        steps = min(max(1, n_batches // accum), ctx.steps_in_task - ctx.step)
        task_seed = sample_seed(int(cfg.seed), ctx.task_index)  # the main loop's batch seed
        gen_ctx = copy.copy(ctx)
        gen_ctx.model = model
        losses = []
        cache = FeatureCache(model, accum, ctx.device) if is_cached(cfg) else None

        def run(b: dict) -> dict:
            return model(b["image"], b["text"])

        with torch.random.fork_rng(devices=[]):
            model.train()
            micro, done = 0, 0
            step_batches = accum if cache is not None else 1  # the main loop's layout
            batches = task_batches(gen_ctx, ctx.task_entries, task_seed, ctx.epoch, step_batches)
            for batch in batches:
                if done >= steps:
                    break
                if micro == 0:
                    s = sample_seed(int(cfg.seed), ctx.task_index, ctx.epoch, done, 515)
                    torch.manual_seed(s)
                    gen_ctx.generator = torch.Generator().manual_seed(s)
                if cache is None:  # plain: each micro-batch its own loss
                    out = run(batch)
                    loss = sum(base_loss(model, batch, out, gen_ctx).values())
                    (loss / accum).backward()
                    losses.append(loss.detach())  # read once after the epoch: no sync per step
                else:  # cached, as the main model's step: the loss of the step's whole batch
                    cache.forward(batch, run)
                    if micro + 1 == accum:
                        whole, out = cache.whole()
                        with cache.loss_pass():
                            loss = sum(base_loss(model, whole, out, gen_ctx).values())
                        cache.backward(loss, run)
                        losses.append(loss.detach())
                micro += 1
                if micro < accum:
                    continue
                micro = 0
                average_gradients(params)
                if cfg.grad_clip > 0:
                    clip = clip_grad_norm_ if is_sharded(model) else torch.nn.utils.clip_grad_norm_
                    clip(params, cfg.grad_clip)
                self.exp_opt.step()
                self.exp_sched.step()
                self.exp_opt.zero_grad(set_to_none=True)
                done += 1
            self.fisher_e = task_fisher(gen_ctx, model, int(self.args["fisher_batches"]))
        # the mean over ranks (each rank's loss is its rows'): every rank holds the value the
        # main process saves, so a multi-process resume logs the metric as before
        self.exp_loss = (
            float(all_reduce_mean(torch.stack(losses).float().mean())) if losses else 0.0
        )
        self.exp_epoch = ctx.epoch

    def before_step(self, ctx: TaskContext) -> None:
        if self.expanded is not None and not ctx.probing:  # a probe measures the step alone
            self._ensure_optimizer(ctx)
            if self.exp_epoch != ctx.epoch:
                with extra(ctx, "afec_expanded"):  # a per-epoch extra (cvl.train.cost)
                    self._expanded_epoch(ctx)
        super().before_step(ctx)  # EWC's anchor, then the expanded one below
        self._value_e = None
        if self.fisher_e is not None:
            from cvl.methods.regularizers import quadratic_penalty

            theta_e = [p.detach() for _, p in trainable(self.expanded)]
            v, od = quadratic_penalty(self.params(ctx), theta_e, self.fisher_e)
            c = self.args["lam_e"] / 2
            self._value_e = c * v
            torch._foreach_mul_(od, 2.0 * c)
            if self._pen_grad is None:
                self._pen_grad = od
            else:
                torch._foreach_add_(self._pen_grad, od)
            # a device tensor: a Python float would be copied to the device by a blocking copy
            dev = theta_e[0].device if theta_e else torch.device("cpu")
            ctx.metrics["afec_expanded_loss"] = to_device(torch.tensor(self.exp_loss), dev)

    def loss(self, batch, out, ctx):
        terms = super().loss(batch, out, ctx)
        if self._value_e is not None:
            terms["afec"] = self._value_e
        return terms

    def after_task(self, ctx: TaskContext) -> None:
        super().after_task(ctx)
        self.expanded, self.exp_opt, self.exp_sched, self.fisher_e = None, None, None, None
        self.exp_epoch, self._value_e = -1, None

    def state_dict(self) -> dict[str, Any]:
        st = super().state_dict()
        if self.expanded is not None and self.fisher_e is not None:
            st["expanded"] = {
                "epoch": self.exp_epoch,
                "loss": self.exp_loss,
                "weights": self.expanded.state_dict(),
                "fisher": dict(zip(self.names, self.fisher_e)),
                "optimizer": self.exp_opt.state_dict(),
                "scheduler": self.exp_sched.state_dict(),
            }
        return st

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        e = (state or {}).get("expanded")
        if not e or self.expanded is None:
            return
        # mid-task resume: before_task made the expanded copy and the loop set steps_in_task
        dev = next(self.expanded.parameters()).device
        self.expanded.load_state_dict(e["weights"])
        self.fisher_e = [e["fisher"][n].to(dev) for n in self.names]
        self.exp_epoch, self.exp_loss = int(e["epoch"]), float(e["loss"])
        self._pending = e  # the optimizer needs steps_in_task: restored in before_step
