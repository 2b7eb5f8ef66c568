"""fp16 loss scaling for the backward passes a method runs outside the training step.

Under `--precision fp16` the loop's GradScaler multiplies each step's loss by its scale S
before the backward, so gradients that pass through float16 activations stay above float16's
smallest normal (2⁻¹⁴; subnormals lose digits below it, and everything under 2⁻²⁴ flushes to
0). A method's own backward passes under the same autocast need the same: the importance
passes (EWC's / MAS's / RWalk's Fisher, AFEC's F_e: `cvl.methods.regularizers`) and IncCLIP's
pseudo-text generation (SGD on token embeddings through the old text tower). `scaled_grads`
is that one mechanism: the loss is multiplied by the loop's current scale S, the gradients
divided by S after; where they overflow, the pass is redone at S·backoff (the scaler's own
rule, down to S = 1). The loop's scaler is read, never updated (these passes are no training
step). A power-of-two S moves only exponents, so in float32 the result is the unscaled one
bit for bit; without a scaler (fp32, bf16, the CPU) nothing changes and nothing is read back.

Each try reads one flag from the device (whether every gradient is finite): fp16 runs only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cvl.dist import world_size


def loop_scaler(ctx: Any) -> Any:
    """The training loop's enabled GradScaler (fp16), or None."""
    acc = getattr(ctx, "accelerator", None)
    scaler = getattr(acc, "scaler", None) if acc is not None else None
    return scaler if scaler is not None and scaler.is_enabled() else None


def scaled_grads(
    loss_of: Callable[[], torch.Tensor],
    grads_of: Callable[[torch.Tensor], list[torch.Tensor | None]],
    scaler: Any,
    agree: bool = False,
) -> list[torch.Tensor | None]:
    """`grads_of(loss)` for the loss `loss_of()` computes, back-propagated at the loop's loss
    scale and unscaled (module docstring); `scaler`: `loop_scaler(ctx)` (None: no scaling).

    `loss_of` runs the forward (again for each try); `grads_of` takes the (scaled) loss and
    returns the gradients (None where a tensor got none), reduced across ranks if the caller
    wants that; the unscaled gradients come back as new tensors. `agree`: ranks that hold different data decide together (one all_reduce of the
    overflow flag per try), so every rank keeps the scale one process would have used; ranks
    whose gradients are already averaged agree without it.
    """
    if scaler is None:
        return grads_of(loss_of())
    scale = float(scaler.get_scale())
    while True:
        grads = grads_of(loss_of() * scale)
        present = [g for g in grads if g is not None]
        if scale <= 1.0 or not present:
            break
        finite = torch.stack([g.isfinite().all() for g in present]).all().float()
        if agree and world_size() > 1:
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if bool(finite):
            break
        scale = max(1.0, scale * scaler.get_backoff_factor())
    unscaled = iter(torch._foreach_div(present, scale))  # new tensors (expanded ones included)
    return [None if g is None else next(unscaled) for g in grads]
