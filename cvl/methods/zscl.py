"""ZSCL (Zheng et al., ICCV 2023, "Preventing zero-shot transfer degradation in continual
learning of vision-language models"), as its public code (Thunderbeee/ZSCL, `mtil/src/models/
finetune.py` and `scripts/ZSCL.sh`) computes it: distillation from the initial model on a
reference set, an L2 pull to the task's starting weights, and a weight ensemble in the task.

- **Reference distillation.** Each optimizer step draws a global batch of `ref_batch` pairs
  (seeded by run seed, task and step; rank r takes slice r) from a reference set given by the
  user: `ref_stream=PATH`, a cvl stream folder (`cvl build-stream ...`; the training pairs
  of all its tasks, or of `ref_task` only). The teacher is the run's **initial** model (the
  code's zero-shot `ref_model`; `teacher=previous` uses the previous task's model). On the
  reference batch (evaluation transform), with v the student's image features, v', w' the
  teacher's image and text features (normalised) and s the teacher's logit scale (the code
  multiplies both by `model.logit_scale`, which it never trains: the pre-trained one)::

      L_ref = T²·[KL(softmax(s·v'w'ᵀ/T) ‖ softmax(s·vw'ᵀ/T))            (image → text rows)
                 + KL(softmax(s·w'v'ᵀ/T) ‖ softmax(s·w'vᵀ/T))]          (text → image rows)

  rows averaged over the global reference batch, T = `temp` = 2. The code's `distillation`
  is the cross-entropy of the student's softened logits against the teacher's probabilities
  (the KL plus the teacher's entropy: the same gradient; cvl logs the KL). Only the image
  tower is distilled: both logit matrices use the **teacher's** text embeddings (the code's
  `ref_embeddings`), the student's text tower gets no distillation gradient. Where the code
  scores ImageNet reference images against a fixed set of Conceptual Captions sentences, the
  reference batch's own captions take their place here.
- **L2** (`--l2 1` in `ZSCL.sh`): `l2`·Σ(θ − θ*)² over the trained parameters, θ* = the
  weights the task started from (the code copies its `l2_model` after loading the previous
  task's checkpoint); its gradient 2·l2·(θ − θ*) is added after backward (not
  backpropagated), logged as `zscl_l2`.
- **Weight ensemble (WE)**: θ̂ ← (n·θ̂ + θ)/(n + 1), n ← n + 1, starting from θ̂ = the weights
  at the task's start (n = 1), after optimizer steps 1, 1 + k, 1 + 2k, … only (the code's
  loop averages at iterations 0, 100, … after that iteration's update, `iteration %
  args.avg_freq == 0`); the model becomes θ̂ at the task's end. So the last step's weights
  join θ̂ only when it is such a step (ZSCL.sh: 1,001 updates, `--iterations 1000`, averaged
  at 0, 100, …, 1000); `we_last=true` averages them in at the task's end otherwise too
  (cvl's earlier rule). k = `we_every` = 100 (`--avg_freq 100`; a task of fewer than 101
  steps then averages only its start and its first step: scale k to the task: the script
  averages in 11 of its 1,001 updates); 0 turns WE off. θ̂ and n are method state (resumable).

Total: the base method's loss + `weight`·L_ref (+ the L2 term).

**The code is the default; each choice is an option**, the alternative being cvl's earlier
reading of the paper's description (a symmetric similarity-logit KL of the student's own image
and text features, as LwF's `variant=logits`): `temp` (2; 1), `temp_squared` (true: the
code's T² factor, Hinton et al.'s; false), `directions` (`sum`: both terms with weight 1, the
code's `--image_loss --text_loss`; `mean`: their average, cvl's earlier; `image`: the image →
text term only, `--image_loss` alone), `pairing` (`teacher_text`: the code; `student`: the
student's own text features in its logits, distilling both towers), `scale` (`teacher`: the
code; `own`: each model's), `we_every` (100, `--avg_freq`; cvl used 10), `we_last` (false: the
code; true: the final weights always join, as cvl had it), `l2` (1, the
script's `--l2 1`; 0 = off, as cvl had it). The paper's text was not available here to check
its own equations against the code (the temperature, the L2 and the pairing are not visible
in its abstract); what is stated above of the code was read in `finetune.py` and
`helpers.py` (`distillation`, `merge_we`, `l2_loss`).

Combining with other methods: like `wise`, `zscl` wraps a base method (`--method-arg
base=NAME`, default `seqft`, every other `--method-arg` goes to it), e.g. `--method zscl
--method-arg ref_stream=streams/ref --method-arg base=ewc`; wrappers do not nest. Logged: the
base terms + `zscl_ref` + `zscl_l2`. Under `--tune` the L2 and WE act on what trains (the
adapters' parameters; the WE averages the weights as they compute). Left for later: a plain
folder of images + captions as reference set (make it a stream with `cvl build-stream` first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cvl.data.index import Entries
from cvl.data.reader import PairDataset, collate, rank_slice, sample_seed
from cvl.data.selection import task_dataset
from cvl.data.transforms import image_transform
from cvl.device import to_device
from cvl.errors import CvlError
from cvl.losses import global_logits, kl_rows
from cvl.methods.base import TaskContext, Wrapper
from cvl.methods.merging import clone_weights, floating_state, write_
from cvl.methods.registry import register
from cvl.methods.regularizers import trainable

DIRECTIONS = ("sum", "mean", "image")


def zscl_distillation(
    image: torch.Tensor,
    text: torch.Tensor,
    t_image: torch.Tensor,
    t_text: torch.Tensor,
    scale: torch.Tensor | float,
    t_scale: torch.Tensor | float,
    temp: float = 2.0,
    temp_squared: bool = True,
    directions: str = "sum",
) -> torch.Tensor:
    """The reference-set distillation over the global batch (see the module docstring).

    `image`, `text`: the student's features in its logits (the code: the student's images and
    the teacher's texts); `t_image`, `t_text`: the teacher's; rows are this rank's samples.
    """
    i2t, t2i, _ = global_logits(image, text, scale)
    with torch.no_grad():
        t_i2t, t_t2i, _ = global_logits(t_image.detach(), t_text.detach(), t_scale)
    loss = kl_rows(t_i2t / temp, i2t / temp)
    if directions != "image":
        t2i_term = kl_rows(t_t2i / temp, t2i / temp)
        loss = loss + t2i_term if directions == "sum" else (loss + t2i_term) / 2
    return loss * temp**2 if temp_squared else loss


@register("zscl")
class ZSCL(Wrapper):
    """ZSCL (its code): distil the initial model on a reference stream + L2 + weight ensemble."""

    defaults = {
        "base": "seqft",
        "ref_stream": "",
        "ref_task": "",
        "ref_batch": 0,
        "weight": 1.0,
        "teacher": "init",
        "temp": 2.0,
        "temp_squared": True,
        "directions": "sum",
        "pairing": "teacher_text",
        "scale": "teacher",
        "we_every": 100,
        "we_last": False,
        "l2": 1.0,
    }

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.check_choice("teacher", ("init", "previous"))
        self.check_choice("directions", DIRECTIONS)
        self.check_choice("pairing", ("teacher_text", "student"))
        self.check_choice("scale", ("teacher", "own"))
        if self.args["temp"] <= 0:
            raise CvlError(f"method 'zscl': temp must be positive (got {self.args['temp']})")
        self.teacher = None
        self.ref: PairDataset | None = None
        self.avg: dict[str, torch.Tensor] | None = None
        self.n_avg = 0
        self.anchor: list[torch.Tensor] | None = None
        self._l2_value: torch.Tensor | None = None

    def accum_refusal(self, cfg: Any) -> str | None:
        """Cached accumulation: only with a reference batch of its own size (`ref_batch`)."""
        if not self.args["ref_batch"]:
            return (
                "ref_batch=0 makes its reference batch as large as the step's, and the student "
                "runs on it with a graph inside the loss (every row's activations at once): "
                "give --method-arg ref_batch=N"
            )
        return super().accum_refusal(cfg)

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        from cvl.streams.manifest import load_manifest

        if not self.args["ref_stream"]:
            raise CvlError(
                "method 'zscl' needs a reference set: --method-arg ref_stream=PATH (a cvl stream)"
            )

        m = load_manifest(Path(self.args["ref_stream"]))
        tasks = [self.args["ref_task"]] if self.args["ref_task"] else list(m.task_order)
        model = ctx.model
        self.ref = PairDataset(
            Entries.concat(task_dataset(m, t).entries for t in tasks),
            transform=image_transform(model.image_size, train=False),
            tokenize=model.tokenizer,
        )
        if self.args["teacher"] == "init":
            self.teacher = ctx.initial_model()

    def before_task(self, ctx: TaskContext) -> None:
        super().before_task(ctx)
        if self.args["teacher"] == "previous":
            self.teacher = ctx.previous_model()
        if self.args["we_every"] > 0:  # on resume load_state_dict replaces it
            self.avg = clone_weights(floating_state(ctx.model))
            self.n_avg = 1
        if self.args["l2"] > 0:  # θ* = the task's start (also on resume: before last/ loads)
            self.anchor = [p.detach().clone() for _, p in trainable(ctx.model)]

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

    # -- L2 to the task's start (analytic gradient, as the regularizers') ------------------------
    def before_step(self, ctx: TaskContext) -> None:
        super().before_step(ctx)
        self._l2_value = None
        if self.anchor is not None:
            with torch.no_grad():
                params = [p.detach() for _, p in trainable(ctx.model)]
                d = torch._foreach_sub(params, self.anchor)
                sq = torch._foreach_norm(d, 2)
                self._l2_value = self.args["l2"] * torch.stack(sq).pow(2).sum()

    def after_backward(self, ctx: TaskContext) -> None:
        super().after_backward(ctx)
        if self.anchor is None:
            return
        params = [p for _, p in trainable(ctx.model)]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with torch.no_grad():
            d = torch._foreach_sub([p.detach() for p in params], self.anchor)
            torch._foreach_add_([p.grad for p in params], d, alpha=2.0 * self.args["l2"])

    def loss(
        self, batch: dict[str, Any], out: dict[str, torch.Tensor], ctx: TaskContext
    ) -> dict[str, torch.Tensor]:
        terms = self.inner.loss(batch, out, ctx)
        if self._l2_value is not None:
            terms["zscl_l2"] = self._l2_value  # value only: its gradient is added after backward
        if self.teacher is None:  # teacher=previous on the first task
            return terms
        a = self.args
        rb = self.ref_batch(ctx)
        with torch.no_grad():
            t_image = self.teacher.encode_image(rb["image"])
            t_text = self.teacher.encode_text(rb["text"])
            t_scale = self.teacher.logit_scale()
        image = ctx.model.encode_image(rb["image"])
        if a["pairing"] == "student":
            text = ctx.model.encode_text(rb["text"])
        else:
            text = t_text
        scale = t_scale if a["scale"] == "teacher" else ctx.model.logit_scale()
        terms["zscl_ref"] = a["weight"] * zscl_distillation(
            image,
            text,
            t_image,
            t_text,
            scale,
            t_scale,
            a["temp"],
            a["temp_squared"],
            a["directions"],
        )
        return terms

    # -- weight ensemble ----------------------------------------------------------------------
    @torch.no_grad()
    def _average_in(self, ctx: TaskContext) -> None:
        n = self.n_avg
        for k, v in floating_state(ctx.model).items():
            a = self.avg[k]
            a.mul_(n / (n + 1)).add_(v.to(a.device), alpha=1.0 / (n + 1))
        self.n_avg = n + 1

    def _averages_after(self, step: int) -> bool:
        """The code's rule: after steps 1, 1 + k, 1 + 2k, … (its iterations 0, k, 2k, …)."""
        every = self.args["we_every"]
        return every > 0 and step >= 1 and (step - 1) % every == 0

    def after_step(self, ctx: TaskContext) -> None:
        super().after_step(ctx)
        if self._averages_after(ctx.step):
            self._average_in(ctx)

    def after_task(self, ctx: TaskContext) -> None:
        if self.args["we_every"] > 0 and self.avg is not None:
            if self.args["we_last"] and not self._averages_after(ctx.step):
                self._average_in(ctx)  # we_last: the final weights join the ensemble
            write_(ctx.model, self.avg)  # the model becomes θ̂
        self.anchor = None
        super().after_task(ctx)

    def own_state(self) -> dict[str, Any]:
        if self.avg is None:
            return {}
        return {"we_avg": dict(self.avg), "we_n": self.n_avg}

    def load_own_state(self, state: dict[str, Any]) -> None:
        if "we_avg" not in state:
            return
        if self.avg is None:
            self.avg = {k: v.clone() for k, v in state["we_avg"].items()}
        else:  # inside a task: into the live average (its device)
            with torch.no_grad():
                for k, v in state["we_avg"].items():
                    self.avg[k].copy_(v)
        self.n_avg = int(state["we_n"])
