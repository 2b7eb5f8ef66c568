"""MoE-Adapters4CL (Yu et al., "Boosting Continual Learning of Vision-Language Models via
Mixture-of-Experts Adapters", CVPR 2024; public code JiazuoYu/MoE-Adapters4CL, its `mtil/`
half, read here with the `fetch` tool): mixture-of-experts adapters on a frozen CLIP, with a
router per task, and the Distribution Discriminative Auto-Selector (DDAS) that picks a task's
router per test sample, or the frozen zero-shot model for unfamiliar inputs.

**Mixture** (`mtil/clip/model.py`, `ResidualAttentionBlock.forward`, `ffn_option='parallel'`,
`ffn_adapt_where='AdapterDoubleEncoder'`): in *every* transformer block of both towers,

    x ← x + Attn(LN1(x));   x ← x + MLP(LN2(x)) + Σ_e g_e(x₀) · A_e(x)

with x₀ the row's first token (CLS / the text's first token) after the attention residual,
A_e(x) = s · W_up · dropout(ReLU(W_down·x + b_down)) + s·b_up the e-th expert (`adapter.py`
`Adapter`: bottleneck r = 64, s = 0.1, dropout 0.1, down Kaiming-uniform, up and biases 0;
no LayerNorm, no residual), applied to every token of the row, and the gates (Shazeer et
al.'s noisy top-k, `noisy_top_k_gating`):

    H = x₀·W_g^t + ε ⊙ (softplus(x₀·W_n^t) + 0.01),  ε ~ N(0, 1) (training only)
    g = softmax over the experts of TopK(H, k), 0 outside the top k            (k = 2)

W_g^t, W_n^t ∈ R^{d×E} (zeros at start) are task t's router (`router_list[task_id]`,
`w_noise_list[task_id]`, one per task); E = 22 experts (`--experts_num 22` in the scripts),
shared by the tasks. The code computes Shazeer's load-balancing loss (cv²(importance) +
cv²(load), × 1e-2) into a local variable and never adds it to the objective; it is not built.

**What trains** (`mtil/src/models/finetune.py` `finetune`): only experts and routers (every
CLIP weight is frozen; so are a ResNet tower's BatchNorm statistics: route −1 is the start); in task t the router of task t and every expert not frozen. Each
task's router is its own parameter, as the code's lists: the other routers are in no later
task's optimizer, so neither their gradient nor weight decay moves them. After each task, for each block of each tower
the `freeze_top` = 2 experts the task's rows chose most often (`choose_map`, counted per row
among its top k over the task's training) are added to the frozen list (`frozen_list_*`
file): frozen for every later task (`--frozen`).

**DDAS** (`mtil/src/models/AutoEncoder.py`, `mtil/src/models/evaluation.py` `zeroshot_eval`):
one autoencoder per task, trained on that task's images: z = σ(feature), ẑ = σ(W2·ReLU(W1·z
+ b1) + b2) (code size 100), MSE(ẑ, z). At test time, with e_t the reconstruction error of
autoencoder t, the route is t* = argmin_t e_t, or the frozen zero-shot model (every adapter
off, `val_task_id = −1`) when e_{t*} > threshold (0.0655 in the scripts); the text side of the
classifier is encoded with the same route.

Defaults: experts 22, top_k 2, bottleneck 64, scale 0.1, dropout 0.1, noise_eps 0.01,
freeze_top 2, code 100, towers both — the code's; they fit any width (the tiny test models
too: r = 64 on a width-64 tower is the code's ratio-free setting; `experts=4 bottleneck=8`
scale it down).

Where cvl differs or the source is silent (each an argument where it matters):

- DDAS features: the code feeds an ImageNet AlexNet's conv features (256×13×13) to the
  autoencoders; cvl has no such weights offline and uses the frozen CLIP's own features (the
  model with every adapter off, L2-normalised u), z = σ(√D·u) so the coordinates have unit
  scale before the sigmoid as conv activations do. The code's threshold is a constant for
  AlexNet features and means nothing here: `threshold` > 0 fixes it (the code's rule), and
  the default 0 calibrates it: after task t, the `quantile` (0.99) of the per-sample errors
  of task t's own training images under its autoencoder; the threshold is the largest over
  the trained tasks (an input is unfamiliar when it reconstructs worse than 99% of every
  task's own data). `threshold=-1` disables the fallback.
- DDAS selects per *sample*; the code selects per test batch (the mean error of its 128
  rows), which makes a prediction depend on its batch neighbours.
- The code's extra autoencoder 0, trained on TinyImageNet and routing to the zero-shot model
  when it wins, needs a pretraining-like data set: not built (the threshold alone falls back).
- Retrieval: cvl's eval encodes texts without their images, so the text tower cannot reuse
  the image's route as the code's classifier does; each adapted tower has its own DDAS
  (autoencoders on the frozen *text* features, same rule and calibration), so every text is
  routed by its own reconstruction errors. `towers=image` keeps the text tower frozen (the
  code's `AdapterImageEncoder`); a ResNet image tower has no blocks (only text is adapted).
- The autoencoders train with the adapters, on the same batches, through the loop's
  optimizer and `--lr` (the code trains them separately with Adam, lr 0.01, 10× decay every
  10 epochs, weight decay 1e-4); their loss `moe_ddas` (× `ddas_weight`) is logged beside the
  base loss and reaches only the autoencoders (the features are frozen).
- The base loss is cvl's (`--base-loss class-ce --base-loss-arg smoothing=0.2` is the code's
  MTIL objective; ITC by default). With a replay buffer the replayed rows train the task's
  router and autoencoder too.
- Router noise and adapter dropout are drawn per step for the global batch from the loop's
  generator, so N processes train as one; the choice counts are summed over ranks each step.
- Every expert runs on every row and is weighted by its gate (0 outside the row's top k): the
  code's sparse dispatch gives the same output, but selecting rows needs the gates on the
  host (a GPU sync per block). The cost is E adapters per token instead of k (for ViT-B/16
  with E = 22, r = 64: about 0.45× the MLP's FLOPs), and an expert that no row of a step
  chose gets a zero gradient rather than none, so AdamW's moments still move it a little
  (in the code it is skipped that step).

Deployed model: every checkpoint holds the adapters, routers, autoencoders, thresholds and
the number of trained tasks (model tensors; run.json's model config records the layout), so
`cvl eval` rebuilds the model and scores it with DDAS routing per sample — nothing else in
the eval changes. The method needs `--tune full` (it decides what trains) and `--model clip`.
"""

from __future__ import annotations

from typing import Any

import torch

from cvl.checks import Num
from cvl.data.reader import PairDataset, eval_loader
from cvl.data.transforms import image_transform
from cvl.dist import all_reduce_mean, world_size
from cvl.errors import CvlError
from cvl.methods import moe_layers as ml
from cvl.methods.base import Method, TaskContext, base_loss
from cvl.methods.registry import register
from cvl.train.accum import frozen_rows
from cvl.train.fsdp import gathered


def freeze_most_chosen(counts: torch.Tensor, frozen: torch.Tensor, n: int) -> torch.Tensor:
    """The code's rule: the n experts chosen most often in this task join the frozen ones."""
    out = frozen.clone()
    if n > 0:
        out[counts.topk(min(n, counts.numel())).indices] = True
    return out


def calibrated_threshold(errors: torch.Tensor, quantile: float, current: float) -> float:
    """max(current, the `quantile` of this task's per-sample training errors)."""
    q = float(torch.quantile(errors.double(), quantile)) if errors.numel() else 0.0
    return max(current, q)


@register("moe_adapters")
class MoEAdapters(Method):
    """MoE-Adapters4CL: MoE adapters (a router per task) on a frozen CLIP + DDAS routing."""

    defaults = {
        "experts": 22,
        "top_k": 2,
        "bottleneck": 64,
        "scale": 0.1,
        "dropout": 0.1,
        "noise_eps": 0.01,
        "freeze_top": 2,
        "code": 100,
        "towers": "both",
        "threshold": 0.0,
        "quantile": 0.99,
        "ddas_weight": 1.0,
    }
    limits = {
        "experts": Num(int, 1),
        "top_k": Num(int, 1),
        "bottleneck": Num(int, 1),
        "dropout": Num(float, 0.0, 1.0, hi_open=True),
        "noise_eps": Num(float, 0.0),
        "freeze_top": Num(int, 0),
        "code": Num(int, 1),
        "threshold": Num(float, 0.0, special={-1.0: "no zero-shot fallback"}),
        "quantile": Num(float, 0.0, 1.0),
        "ddas_weight": Num(float, 0.0),
    }
    tunes = ("full",)

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.check_choice("towers", ml.TOWERS)
        if self.args["top_k"] > self.args["experts"]:
            raise CvlError(
                f"method 'moe_adapters': top_k ({self.args['top_k']}) > experts "
                f"({self.args['experts']})"
            )

    def spec(self, n_tasks: int) -> dict[str, Any]:
        """The layers' settings recorded in the model config."""
        keys = ("experts", "top_k", "bottleneck", "scale", "dropout", "noise_eps", "code")
        return {**{k: self.args[k] for k in keys}, "towers": self.args["towers"], "tasks": n_tasks}

    def prepare_model(self, model: Any, manifest: Any) -> Any:
        """Before run.json and init/ are written: the layers become part of the model, and
        CLIP's own parameters are frozen (run.json's `tuning` counts what can train)."""
        if not hasattr(model, "clip"):  # the fusion model (ViT + BERT): no open_clip blocks
            raise CvlError(
                "method 'moe_adapters' adapts open_clip's transformer blocks: use --model clip "
                "(the fusion model's ViT and BERT towers have none)"
            )
        blocks = [
            getattr(model.clip, "transformer", None),
            getattr(model.clip.visual, "transformer", None),
        ]
        if any(getattr(t, "grad_checkpointing", False) for t in blocks):
            raise CvlError(
                "method 'moe_adapters' does not combine with --grad-checkpointing (the recomputed "
                "blocks would count their experts' choices twice)"
            )
        model = ml.attach(model, self.spec(len(manifest.task_order)))
        for n, p in model.named_parameters():
            if ".moe." not in n and not n.startswith("moe_state."):
                p.requires_grad_(False)
        return model

    def _layers(self, model: Any) -> list[ml.MoEAdapter]:
        return [m for w in model.moe_state.ddas for m in ml.moe_layers(model, w)]

    def before_task(self, ctx: TaskContext) -> None:
        """Freeze CLIP; train task t's routers and autoencoders and the unfrozen experts."""
        model, t = ctx.model, ctx.task_index
        if not hasattr(model, "moe_state"):
            raise CvlError("method 'moe_adapters': the model has no MoE layers (prepare_model)")
        model.moe_state.task = t
        for p in model.parameters():
            p.requires_grad_(False)
        for m in self._layers(model):
            m.w_gate[t].requires_grad_(True)  # task t's router only: the others do not
            m.w_noise[t].requires_grad_(True)  # train (not in the optimizer: no decay moves them)
            for e, expert in enumerate(m.experts):
                for p in expert.parameters():
                    p.requires_grad_(not bool(m.frozen[e]))
            m.take_pending()
            if not ctx.resuming:
                m.counts.zero_()
        for ae in model.moe_state.ddas.values():
            for p in (*ae.enc[t].parameters(), *ae.dec[t].parameters()):
                p.requires_grad_(True)

    def before_step(self, ctx: TaskContext) -> None:
        seed = ctx.generator.initial_seed()  # re-seeded every step, the same on all ranks
        for m in self._layers(ctx.model):
            m.seed = seed

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = base_loss(ctx.model, batch, out, ctx)
        st, t = ctx.model.moe_state, ctx.task_index
        ae_loss = 0.0
        for tower, ae in st.ddas.items():
            with torch.no_grad():
                x = batch["image"] if tower == "image" else batch["text"]
                # the frozen CLIP (adapters off), a micro-batch at a time when cached
                f0 = frozen_rows(ml.zero_shot_features, ctx.model, tower, x)
                u = torch.nn.functional.normalize(f0.float(), dim=-1)
            ae_loss = ae_loss + ae.error(u, t).mean()
        terms["moe_ddas"] = self.args["ddas_weight"] * ae_loss
        return terms

    @torch.no_grad()
    def after_step(self, ctx: TaskContext) -> None:
        """The step's choice counts, summed over ranks, join the task's (the same on every
        rank, so every rank freezes the same experts)."""
        layers = self._layers(ctx.model)
        step = torch.stack([m.take_pending() for m in layers])
        if world_size() > 1:
            step = all_reduce_mean(step) * world_size()
        for m, c in zip(layers, step):
            m.counts += c

    @torch.no_grad()
    def after_task(self, ctx: TaskContext) -> None:
        model, t = ctx.model, ctx.task_index
        for m in self._layers(model):
            m.frozen.copy_(freeze_most_chosen(m.counts, m.frozen, self.args["freeze_top"]))
        thr = self.args["threshold"]
        for tower, ae in model.moe_state.ddas.items():
            if thr != 0:
                ae.threshold.fill_(max(thr, 0.0))
            else:
                errs = self._own_errors(ctx, tower, t)
                ae.threshold.fill_(
                    calibrated_threshold(errs, self.args["quantile"], float(ae.threshold))
                )
        model.moe_state.done.fill_(t + 1)

    def _own_errors(self, ctx: TaskContext, tower: str, t: int) -> torch.Tensor:
        """Autoencoder t's per-sample errors on this task's own training pairs (all ranks')."""
        model = ctx.model
        ds = PairDataset(
            self.own_entries(ctx), image_transform(model.image_size, train=False), model.tokenizer
        )
        was = model.training
        model.eval()
        errs = []
        rank, world = ctx.accelerator.process_index, ctx.accelerator.num_processes
        with gathered(model):  # --fsdp: ranks may embed different numbers of batches
            for b in eval_loader(ds, 256, rank=rank, world=world):
                x = (b["image"] if tower == "image" else b["text"]).to(ctx.device)
                u = torch.nn.functional.normalize(
                    ml.zero_shot_features(model, tower, x).float(), dim=-1
                )
                errs.append(model.moe_state.ddas[tower].error(u, t).float())
        model.train(was)
        local = torch.cat(errs) if errs else torch.zeros(0)
        if world > 1:
            from cvl.evaluation.embed import _gather_rows

            return _gather_rows(local[:, None], ctx.accelerator, len(ds))[:, 0].cpu()
        return local.cpu()
