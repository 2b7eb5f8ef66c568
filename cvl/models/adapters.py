"""The adapter modules of `cvl train --tune lora|dora|vera`: `Adapter` (LoRA, and DoRA with its
per-row magnitude) and `VeraAdapter` with the frozen random projections it shares
(`VeraProjections`), each a parametrization of one frozen weight (`WeightAdapter`). The
formulas, their papers and peft's layouts are in `cvl.models.tune`'s docstring.

Kept apart from `cvl.models.tune`, which decides which weights get one, reads and writes the
weights of an adapted model and sets up a run's tuning. `cvl.models.tune` re-exports every name.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cvl.errors import CvlError


def _row_norm(w: torch.Tensor) -> torch.Tensor:
    """‖row‖ of each output row (dim 0) over all other dims, as a column for broadcasting."""
    n = torch.linalg.vector_norm(w.flatten(1), dim=1)
    return n.view(-1, *([1] * (w.ndim - 1)))


class WeightAdapter(nn.Module):
    """A parametrization W ↦ W + ΔW whose task-time delta is reset, scaled and merged."""

    def zero_(self, w: torch.Tensor) -> None:
        """No delta: the parametrized weight is `w` exactly."""
        raise NotImplementedError

    def reset_(self, w: torch.Tensor, generator: torch.Generator) -> None:
        """A fresh adapter (its random parts from `generator`), computing `w` exactly."""
        raise NotImplementedError

    def scale_(self, alpha: float) -> None:
        """ΔW ← α·ΔW (C-CLIP's integration coefficient before the merge)."""
        raise NotImplementedError


class Adapter(WeightAdapter):
    """LoRA (and DoRA's magnitude) as a parametrization: W ↦ W + s·B·A (then m ⊙ V/‖V‖).

    `parts` = p > 1 splits the output rows into p equal blocks, each with its own rank-r
    factors (A: p·r × fan_in, the blocks' A_i stacked; B: out × r, block i's rows B_i):
    ΔW = s·[B_1·A_1; ...; B_p·A_p], rank up to p·r — FoMo-in-Flux's `LoRA_MHA` on the fused
    q/k/v in-projection (p = 3). p = 1 is plain LoRA."""

    def __init__(
        self, weight: torch.Tensor, rank: int, alpha: float, dora: bool, parts: int = 1
    ) -> None:
        super().__init__()
        out, fan_in = weight.shape[0], math.prod(weight.shape[1:])
        if out % parts:
            raise CvlError(f"a {parts}-part adapter needs rows divisible by {parts} (got {out})")
        kw = {"device": weight.device, "dtype": weight.dtype}
        self.lora_A = nn.Parameter(torch.zeros(parts * rank, fan_in, **kw))
        self.lora_B = nn.Parameter(torch.zeros(out, rank, **kw))
        self.parts = parts
        self.dora = dora
        if dora:
            self.magnitude = nn.Parameter(_row_norm(weight.detach()).reshape(-1).clone())
        self.scale = float(alpha) / rank

    def product(self) -> torch.Tensor:
        """B·A (out × fan_in); per block of rows with `parts` > 1."""
        if self.parts == 1:
            return self.lora_B @ self.lora_A
        p, (out, r), fan_in = self.parts, self.lora_B.shape, self.lora_A.shape[1]
        blocks = self.lora_B.view(p, out // p, r) @ self.lora_A.view(p, r, fan_in)
        return blocks.reshape(out, fan_in)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        v = w + self.product().view_as(w) * self.scale
        if not self.dora:
            return v
        # ‖V‖ detached (DoRA §4.3); with B = 0 and m = ‖W‖ this returns W exactly (x/x = 1)
        norm = _row_norm(v).detach().clamp_min(1e-12)
        return v * (self.magnitude.view_as(norm) / norm)

    @torch.no_grad()
    def zero_(self, w: torch.Tensor) -> None:
        """No delta: B = 0 (and m = ‖W‖), so the parametrized weight is `w` exactly."""
        self.lora_B.zero_()
        if self.dora:
            self.magnitude.copy_(_row_norm(w).reshape(-1))

    @torch.no_grad()
    def reset_(self, w: torch.Tensor, generator: torch.Generator) -> None:
        """A fresh adapter: A Kaiming-uniform (a = √5, nn.Linear's and peft's) from `generator`."""
        a = torch.empty(self.lora_A.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A.copy_(a)
        self.zero_(w)

    @torch.no_grad()
    def scale_(self, alpha: float) -> None:
        if self.dora:  # m ⊙ V/‖V‖ is not linear in the delta
            raise CvlError("a DoRA adapter's delta cannot be scaled (use --tune lora or vera)")
        self.lora_B.mul_(alpha)


def _kaiming_uniform(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """U(−b, b), b = √3·√2/√fan_in, fan_in = shape[1] (peft's VeRA `_kaiming_init`)."""
    t = torch.empty(shape)
    bound = math.sqrt(3.0) * math.sqrt(2.0) / math.sqrt(shape[1])
    return t.uniform_(-bound, bound, generator=generator)


class VeraProjections:
    """VeRA's shared frozen pair (A: rank × max fan-in, B: max fan-out × rank), drawn from
    `seed` on the CPU (A first, as peft), with one copy per device and dtype that asks.

    A plain object (not a module): the adapters that share it hold a reference, so it is in no
    state dict and a deep copy of the model shares one copy among its adapters."""

    def __init__(self, rank: int, out: int, fan_in: int, seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(int(seed))
        self.A = _kaiming_uniform((rank, fan_in), g)
        self.B = _kaiming_uniform((out, rank), g)
        self._on: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def on(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._on:
            self._on[key] = (self.A.to(device, dtype), self.B.to(device, dtype))
        return self._on[key]


class VeraAdapter(WeightAdapter):
    """VeRA as a parametrization: W ↦ W + Λ_b·B·Λ_d·A (A, B the shared frozen blocks)."""

    def __init__(self, weight: torch.Tensor, shared: VeraProjections, d_initial: float) -> None:
        super().__init__()
        out = weight.shape[0]
        kw = {"device": weight.device, "dtype": weight.dtype}
        rank = shared.A.shape[0]
        self.vera_lambda_d = nn.Parameter(torch.full((rank,), float(d_initial), **kw))
        self.vera_lambda_b = nn.Parameter(torch.zeros(out, **kw))
        self.shared = shared
        self.d_initial = float(d_initial)

    def delta(self, w: torch.Tensor) -> torch.Tensor:
        a, b = self.shared.on(w.device, w.dtype)
        out, fan_in = w.shape[0], math.prod(w.shape[1:])
        d = self.vera_lambda_d.unsqueeze(-1) * a[:, :fan_in]
        return ((self.vera_lambda_b.unsqueeze(-1) * b[:out]) @ d).view_as(w)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.delta(w)

    @torch.no_grad()
    def zero_(self, w: torch.Tensor) -> None:
        """No delta: b = 0 (d is kept: it scales nothing while b is 0)."""
        self.vera_lambda_b.zero_()

    @torch.no_grad()
    def reset_(self, w: torch.Tensor, generator: torch.Generator) -> None:
        """A fresh adapter: d = d_initial, b = 0 (A and B are the run's, not redrawn)."""
        self.vera_lambda_d.fill_(self.d_initial)
        self.zero_(w)

    @torch.no_grad()
    def scale_(self, alpha: float) -> None:
        self.vera_lambda_b.mul_(alpha)
