"""A LoRA per task kept separate, as FoMo-in-Flux's `lora_per_task` (Roth et al. 2024; public
fork pseudope/fomo_in_flux, `continual_lib/lora_per_task.py`, configs
`continualfomo_lora_average.yaml` and `continualfomo_lora_max_logits.yaml`).

Every task trains a fresh adapter on the frozen initial weights θ_0 (FoMo: `_attach_adapters`
on the untouched backbone in `prepare_for_training`; the base weights never change), and the
task's trained adapter is stored (`end_task`: `stored_adapters`), not merged into the base.
What is deployed after task t — the checkpoint `cvl eval` scores — is the `route`:

- `average` (default; FoMo's `max_logits_inference: False`, `attach_average_adapter`): one
  adapter whose every tensor is the element-wise mean of the stored adapters' (LoRA:
  Ā = mean_k A_k, B̄ = mean_k B_k, so ΔW = s·B̄·Ā — FoMo averages the factors, *not* the deltas
  s·B_k·A_k; DoRA's m and VeRA's d, b likewise):  θ_t = θ_0 + ΔW(Ā, B̄);
- `task` (task identity at test time, an oracle routing): θ_t = θ_0 + ΔW_t, the task's own
  adapter. With the task id known, test set j is scored by adapter j: R[j][j], the diagonal
  of this run's R matrix (`cvl eval`'s "so far" / diagonal numbers); the rows' other entries
  are one adapter's transfer to the other tasks, and the final row is the last task's expert.

FoMo's other routing, `max_logits_inference: True` (`max_logits_over_stored_adapters`: run
the model with each stored adapter and take the element-wise maximum of the logits), is not
built: it is not one set of weights, and cvl's checkpoints are plain `model.safetensors`
that `cvl eval` scores as one model (it would need K passes per set and a max over K
similarity matrices in every metric).

The adapter is cvl's `--tune lora` (or `dora`, `vera`): the method requires one. Its
structure (`structure`):

- `fomo` (default): FoMo's LoRA as its code builds it for open_clip (`_attach_adapters`,
  `LoRA_MHA`, `LoRA_Linear`; `configs/config.yaml` `lora_per_task`: rank 5, scale 1,
  `kv_only: False`, every residual block of both towers): the attention's fused in-projection
  gets separate rank-5 factors for q, k and v (ΔW_in = [B_q·A_q; B_k·A_k; B_v·A_v], rank up
  to 15), the MLP's second layer (`c_proj`) a LoRA; the MLP's first layer is skipped (its
  name holds "fc", which the code excludes) and so is the attention's out-projection (the
  code attaches an adapter to it, but `nn.MultiheadAttention` reads `out_proj.weight` directly,
  never calling it). As `--tune-arg`s: rank=5 alpha=5 qkv=split targets=
  `*resblocks.*.attn.in_proj_weight+*resblocks.*.mlp.c_proj.weight`; any `--tune-arg` given
  overrides its part (`--tune vera` takes the targets only: its rank is VeRA's own). The code's class default `kv_only=True`
  (k and v only) is not what its config runs. A ResNet tower has no residual blocks: it gets
  no adapters (FoMo runs ViTs). FoMo draws A Kaiming-uniform with a = √rank, cvl with a = √5:
  the same at rank 5.
- `tune`: the `--tune-arg`s as given (cvl's defaults: rank 8, α = 8, one fused factor over
  every linear weight, the MLP's first layer and the out-projection included).

The method wraps a base method (`base=NAME`, default `seqft`: FoMo's plain contrastive
training), whose losses and hooks run unchanged; the stored adapters (one set of small
tensors per task) are method state, saved with each task and restored on resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from cvl.methods.base import TaskContext, Wrapper
from cvl.methods.registry import register
from cvl.models.tune import adapter_tensors, assign_, load_adapter_tensors, trained_names
from cvl.runs import MODEL_FILE

ROUTES = ("average", "task")
STRUCTURES = ("fomo", "tune")
#: FoMo-in-Flux's LoRA structure for open_clip as `--tune-arg` defaults (module docstring)
FOMO_LORA = {
    "rank": 5,
    "alpha": 5.0,
    "qkv": "split",
    "targets": "*resblocks.*.attn.in_proj_weight+*resblocks.*.mlp.c_proj.weight",
}


def average_adapters(stored: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of each adapter tensor over the stored adapters (FoMo's
    `_average_adapter_state`)."""
    return {k: torch.stack([s[k] for s in stored]).mean(dim=0) for k in stored[0]}


@register("lora_per_task")
class LoRAPerTask(Wrapper):
    """A LoRA per task on the frozen start, kept separate; deploys their average (FoMo) or the task's own."""

    defaults = {"base": "seqft", "route": "average", "structure": "fomo"}
    tunes = ("lora", "dora", "vera")

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        super().__init__(args)
        self.check_choice("route", ROUTES)
        self.check_choice("structure", STRUCTURES)
        if self.args["structure"] == "fomo":  # FoMo's LoRA; VeRA: its targets only
            vera = {"targets": FOMO_LORA["targets"]}
            self.tune_defaults = {"lora": FOMO_LORA, "dora": FOMO_LORA, "vera": vera}
        self.stored: list[dict[str, torch.Tensor]] = []

    def before_task(self, ctx: TaskContext) -> None:
        """The base weights go back to θ_0 (the loop gave the task a fresh adapter already)."""
        init = load_file(str(Path(ctx.run_dir) / "init" / MODEL_FILE))
        trained = trained_names(ctx.model) or frozenset(init)
        assign_(ctx.model, {k: v for k, v in init.items() if k in trained})
        super().before_task(ctx)

    def after_task(self, ctx: TaskContext) -> None:
        """Store the task's adapter; leave the routed one for the loop to merge into θ_0."""
        super().after_task(ctx)
        self.stored.append(
            {k: v.to("cpu", copy=True) for k, v in adapter_tensors(ctx.model).items()}
        )
        if self.args["route"] == "average":
            load_adapter_tensors(ctx.model, average_adapters(self.stored))

    def own_state(self) -> dict[str, Any]:
        return {"stored": {str(i): s for i, s in enumerate(self.stored)}}

    def load_own_state(self, state: dict[str, Any]) -> None:
        st = state.get("stored") or {}
        self.stored = [dict(st[str(i)]) for i in range(len(st))]
