"""ZSCL-style continual training (Zheng et al., ICCV 2023, "Preventing zero-shot transfer
degradation in continual learning of vision-language models"): distillation on a reference
image-text set + weight-space ensembling within each task.

- **Reference distillation.** Each optimizer step draws a global batch of `ref_batch` pairs
  (seeded by run seed, task and step; rank r takes slice r) from a reference set given by the
  user: `ref_stream=PATH`, a cvl stream folder (`cvl build-stream ...`; the training pairs
  of all its tasks, or of `ref_task` only). The teacher is the run's **initial** model (the
  pre-trained weights, ZSCL's choice; `teacher=previous` uses the previous task's model). On
  the reference batch (evaluation transform), with each model's own logit scale s::

      L_ref = ½ [KL(softmax(s'·v'w'ᵀ) ‖ softmax(s·vwᵀ)) + KL(softmax(s'·w'v'ᵀ) ‖ softmax(s·wvᵀ))]

  rows averaged, over the global reference batch (LwF's similarity-logit distillation, here on
  reference data; ZSCL distils image→text-label logits on ImageNet-style reference images,
  our captions take the place of its class-name texts).
- **Weight ensemble (WE).** Every `we_every` steps θ̂ ← (n·θ̂ + θ)/(n + 1), n ← n + 1, starting
  from θ̂ = the weights at the task's start (n = 1); at the task's end the model becomes θ̂
  (with the final θ added). θ̂ and n are method state (resumable).

Total: the base method's loss + λ·L_ref, λ = `weight` = 1 (ZSCL's); `we_every` = 0 turns WE
off. Combining with other methods: like `wise`, `zscl` wraps a base method (`--method-arg
base=NAME`, default `seqft`, every other `--method-arg` goes to it), e.g. `--method zscl
--method-arg ref_stream=streams/ref --method-arg base=ewc`; `--method wise --method-arg
base=zscl` is refused (one wrapper at a time). Logged: the base terms + `zscl_ref`.
Left for later: a plain folder of images + captions as reference set (make it a stream with
`cvl build-stream` first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cvl.data.reader import PairDataset, collate, rank_slice, sample_seed
from cvl.data.transforms import image_transform
from cvl.device import to_device
from cvl.errors import CvlError
from cvl.methods.base import TaskContext, frozen_copy
from cvl.methods.lwf import logit_kd
from cvl.methods.registry import register
from cvl.methods.wise import Wrapper, floating_state, interpolate_


@register("zscl")
class ZSCL(Wrapper):
    """ZSCL: distil the initial model on a reference stream + weight ensembling (wraps a method)."""

    defaults = {
        "base": "seqft",
        "ref_stream": "",
        "ref_task": "",
        "ref_batch": 0,
        "weight": 1.0,
        "teacher": "init",
        "we_every": 10,
    }

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.check_choice("teacher", ("init", "previous"))
        self.teacher = None
        self.ref: PairDataset | None = None
        self.avg: dict[str, torch.Tensor] | None = None
        self.n_avg = 0

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        from cvl.streams.manifest import load_manifest

        if not self.args["ref_stream"]:
            raise CvlError(
                "method 'zscl' needs a reference set: --method-arg ref_stream=PATH (a cvl stream)"
            )

        m = load_manifest(Path(self.args["ref_stream"]))
        tasks = [self.args["ref_task"]] if self.args["ref_task"] else list(m.task_order)
        shards = [s for t in tasks for s in m.train_shards(t)]
        model = ctx.model
        self.ref = PairDataset.from_shards(
            shards,
            transform=image_transform(model.image_size, train=False),
            tokenize=model.tokenizer,
        )
        if self.args["teacher"] == "init":
            from cvl.models import load_weights
            from cvl.runs import MODEL_FILE

            self.teacher = frozen_copy(model)
            load_weights(self.teacher, Path(ctx.run_dir) / "init" / MODEL_FILE)

    def before_task(self, ctx: TaskContext) -> None:
        super().before_task(ctx)
        if self.args["teacher"] == "previous":
            self.teacher = ctx.previous_model()
        if self.args["we_every"] > 0:  # on resume load_state_dict replaces it
            self.avg = {k: v.detach().clone() for k, v in floating_state(ctx.model).items()}
            self.n_avg = 1

    def ref_batch(self, ctx: TaskContext) -> dict[str, Any]:
        """This rank's slice of the step's reference global batch (a function of the step)."""
        world = ctx.accelerator.num_processes if ctx.accelerator is not None else 1
        rank = ctx.accelerator.process_index if ctx.accelerator is not None else 0
        n = self.args["ref_batch"] or ctx.config.batch_size * world
        g = torch.Generator().manual_seed(
            sample_seed(int(ctx.config.seed), ctx.task_index, 313, ctx.step)
        )
        idx = torch.randint(len(self.ref), (n,), generator=g).tolist()
        b = collate([self.ref[i] for i in rank_slice(idx, rank, world)])
        return {k: to_device(b[k], ctx.device) for k in ("image", "text")}  # no host sync

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = self.inner.loss(batch, out, ctx)
        if self.teacher is None:  # teacher=previous on the first task
            return terms
        rb = self.ref_batch(ctx)
        ref_out = ctx.model(rb["image"], rb["text"])
        with torch.no_grad():
            t_out = self.teacher(rb["image"], rb["text"])
        terms["zscl_ref"] = self.args["weight"] * logit_kd(
            ref_out["image_features"],
            ref_out["text_features"],
            t_out["image_features"],
            t_out["text_features"],
            ref_out["logit_scale"],
            t_out["logit_scale"],
        )
        return terms

    @torch.no_grad()
    def _average_in(self, ctx: TaskContext) -> None:
        n = self.n_avg
        for k, v in floating_state(ctx.model).items():
            a = self.avg[k]
            a.mul_(n / (n + 1)).add_(v.detach().to(a.device), alpha=1.0 / (n + 1))
        self.n_avg = n + 1

    def after_step(self, ctx: TaskContext) -> None:
        super().after_step(ctx)
        every = self.args["we_every"]
        if every > 0 and ctx.step % every == 0 and ctx.step < ctx.steps_in_task:
            self._average_in(ctx)

    def after_task(self, ctx: TaskContext) -> None:
        if self.args["we_every"] > 0 and self.avg is not None:
            self._average_in(ctx)  # the final weights join the ensemble
            interpolate_(ctx.model, self.avg, 0.0)  # the model becomes θ̂
        super().after_task(ctx)

    def own_state(self) -> dict[str, Any]:
        if self.avg is None:
            return {}
        return {"we_avg": dict(self.avg), "we_n": self.n_avg}

    def load_own_state(self, state: dict[str, Any]) -> None:
        if "we_avg" in state:
            self.avg = {k: v.clone() for k, v in state["we_avg"].items()}
            self.n_avg = int(state["we_n"])
