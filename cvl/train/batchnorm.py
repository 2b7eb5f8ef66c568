"""BatchNorm statistics over the global batch (`cvl train --sync-bn`), on any device.

With several processes each BatchNorm layer in training mode normalises by the statistics of
its own process's rows unless it is synchronised. For cvl's promise that N processes × batch
B train as 1 process × N·B, the mean and variance must be those of all N·B rows, and their
gradient must reach every rank's rows: that is `torch.nn.SyncBatchNorm`. Its training forward
runs only on GPU-like devices (torch 2.14 raises "SyncBatchNorm expected input tensor to be on
GPU or XPU ..." for CPU tensors: `batch_norm_stats` and its siblings have no CPU kernels), so
`GlobalBatchNorm` keeps torch's layer (and kernels) where torch runs it and computes the same
statistics with ordinary ops and one all_gather with gradient elsewhere (the CPU, gloo; the
world's process group, as every collective of cvl's: `cvl.dist`).

The maths (per channel, n_r rows × spatial positions on rank r, its mean m_r and sum of squared
deviations M2_r; Chan et al.'s pairwise combination, as torch's
`batch_norm_gather_stats_with_counts`):

    N = Σ n_r      μ = Σ n_r·m_r / N      σ² = Σ [M2_r + n_r·(m_r − μ)²] / N
    y = (x − μ) / √(σ² + ε) · γ + β

and the running statistics move by `momentum` towards μ and the unbiased σ²·N/(N−1), as in one
process. The gather carries gradient (`torch.distributed.nn.functional.all_gather`: its
backward sums every rank's gradient of the statistics), so the backward is that of one
BatchNorm over the global batch, which is what SyncBatchNorm's backward computes.

`--sync-bn` (`TrainConfig.sync_bn`): `auto` (the default, and the meaning of a run.json written
before the option existed) synchronises on CUDA only and keeps per-process statistics
elsewhere with a note; `on` synchronises on every device; `off` never does (plain DDP).
"""

from __future__ import annotations

import torch
from torch import nn

from cvl.dist import gather_with_grad, world_size
from cvl.train.plan import BN_MESSAGE

SYNC_BN_CHOICES = ("auto", "on", "off")

# Measured with `benchmarks/batchnorm_sync.py` (2-core CPU; docs/scaling.md, "BatchNorm
# statistics"): the tiny ResNet CLIP, 3 tasks × 6 steps, 2 processes × 8 vs 1 × 16 pairs, SeqFT.
# Per process: the first loss 0.17 apart, the worst step 0.43, 423,245 of 513,885 weights more
# than 1e-4 apart at the end (the largest 0.009, as far as 18 steps at lr 5e-4 go), running
# means 0.06. Synchronised: losses within 9e-5, 2 weights beyond 1e-4 (Adam-normalised rounding).
PER_PROCESS_EFFECT = (
    "2 x 8 vs 1 x 16 pairs on the tiny ResNet CLIP: losses of ~2.8 up to 0.43 apart from the "
    "first step on, 82% of the weights more than 1e-4 apart after 18 steps"
)


def _torch_runs_it(device: torch.device) -> bool:
    """Whether torch's SyncBatchNorm trains on tensors of `device` (its own device check)."""
    return device.type in ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


class GlobalBatchNorm(nn.SyncBatchNorm):
    """`nn.SyncBatchNorm` that also trains on the CPU (module docstring): torch's forward where
    torch runs it, the same statistics by one all_gather with gradient elsewhere. Outside
    training, or in a single process, it is BatchNorm (`F.batch_norm`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or world_size() == 1 or _torch_runs_it(input.device):
            return super().forward(input)
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        return _global_batch_norm(self, input, factor)


def _global_batch_norm(bn: GlobalBatchNorm, x: torch.Tensor, factor: float) -> torch.Tensor:
    """BatchNorm of `x` [N, C, ...] with the statistics of every rank's rows (module docstring);
    updates `bn`'s running statistics with `factor`."""
    c = x.shape[1]
    dims = [0, *range(2, x.dim())]
    xf = x.float()  # statistics in float32 (bf16 autocast hands BatchNorm bf16 maps)
    n = float(x.numel() // c)
    mean = xf.mean(dims) if n else xf.new_zeros(c)
    m2 = ((xf - mean.view(1, c, *[1] * (x.dim() - 2))) ** 2).sum(dims)
    local = torch.cat([mean, m2, xf.new_full((1,), n)])
    stats = gather_with_grad(local[None])  # [W, 2C + 1]: every rank's, with gradient
    means, m2s, counts = stats[:, :c], stats[:, c : 2 * c], stats[:, 2 * c :].detach()
    total = counts.sum()
    if float(total) <= 1:  # torch's own refusal, so the loop's one-line message applies
        raise ValueError(f"{BN_MESSAGE} when training, got input size {int(total)}")
    mu = (counts * means).sum(0) / total
    var = (m2s + counts * (means - mu) ** 2).sum(0) / total
    if bn.track_running_stats and bn.running_mean is not None:
        with torch.no_grad():
            bn.running_mean.lerp_(mu.to(bn.running_mean.dtype), factor)
            unbiased = var * (total / (total - 1))
            bn.running_var.lerp_(unbiased.to(bn.running_var.dtype), factor)
    shape = (1, c, *[1] * (x.dim() - 2))
    y = (xf - mu.view(shape)) * torch.rsqrt(var + bn.eps).view(shape)
    if bn.affine:
        y = y * bn.weight.view(shape) + bn.bias.view(shape)
    return y.to(x.dtype)


def to_global_batchnorm(module: nn.Module) -> nn.Module:
    """`module` with every BatchNorm layer replaced by a `GlobalBatchNorm` sharing its
    parameters and buffers (torch's `convert_sync_batchnorm`, to this class)."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, GlobalBatchNorm
    ):
        out = GlobalBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            bias=module.bias is not None,
        )
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, to_global_batchnorm(child))
    return out


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def sync_batchnorm(
    model: nn.Module, mode: str, device: torch.device, processes: int
) -> tuple[nn.Module, str | None]:
    """The model as `--sync-bn MODE` trains it on `processes` processes on `device`, and the
    note to print (None: nothing to say). Models without BatchNorm and single processes are
    returned as they are."""
    if processes == 1 or not has_batchnorm(model):
        return model, None
    if mode == "on" or (mode == "auto" and device.type == "cuda"):
        return to_global_batchnorm(model), None
    if mode == "off":
        return model, None
    return model, (
        f"note: the model has BatchNorm, and --sync-bn auto keeps its statistics per process "
        f"on {device.type}: {processes} processes x batch B do not train as 1 x {processes}B "
        f"(measured, {PER_PROCESS_EFFECT}); --sync-bn on computes them over the global batch "
        "(then N x B = 1 x NB), --sync-bn off keeps them per process without this note"
    )


def batchnorm_statistics(model: nn.Module, processes: int) -> str | None:
    """run.json's record of how the model's BatchNorm layers train: "global" (synchronised),
    "per process", "one process"; None without BatchNorm."""
    if not has_batchnorm(model):
        return None
    if processes == 1:
        return "one process"
    sync = any(isinstance(m, GlobalBatchNorm) for m in model.modules())
    return "global" if sync else "per process"
