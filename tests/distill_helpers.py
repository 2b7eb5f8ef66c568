"""One loss + backward on 2 gloo processes × 8 rows vs 1 process × 16 rows (no optimizer).

Adam turns float noise in tiny gradient entries into full-size steps, so end-to-end weight
comparisons (test_distributed) are loose; comparing the averaged gradients of one step checks
the global-batch arithmetic of a method's loss directly and tightly.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from device_helpers import spawn_env, start_method

N = 16


def _setup(method: str, args: dict):
    from cvl.methods.base import TaskContext, frozen_copy
    from cvl.methods.registry import get_method
    from cvl.models import build_model

    torch.manual_seed(0)
    model = build_model("clip", "tiny-vit", pretrained=None)
    model.train()
    old = frozen_copy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an old model that differs: some rows right, some wrong
        for p in old.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    images = torch.randn(N, 3, model.image_size, model.image_size, generator=g)
    texts = torch.randint(1, 1000, (N, model.context_length), generator=g)
    m = get_method(method)(args)
    m.old = old
    ctx = TaskContext(model=model, accelerator=None, config=None, manifest=None, run_dir=None)
    return model, m, ctx, images, texts


def _step(method: str, args: dict, rows: slice):
    from cvl.dist import all_reduce_mean, average_gradients

    model, m, ctx, images, texts = _setup(method, args)
    batch = {"image": images[rows], "text": texts[rows]}
    out = model(batch["image"], batch["text"])
    terms = m.loss(batch, out, ctx)
    sum(terms.values()).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    average_gradients(params)
    vals = {k: float(all_reduce_mean(v.detach())) for k, v in terms.items()}
    vals.update({k: float(all_reduce_mean(torch.as_tensor(v))) for k, v in ctx.metrics.items()})
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return vals, grads


def _worker(rank: int, port: int, method: str, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        res = _step(method, args, slice(rank * N // 2, (rank + 1) * N // 2))
        if rank == 0:
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


def two_vs_one(method: str, args: dict, tmp_path) -> tuple[tuple, tuple]:
    """((values, grads) with 2 processes, (values, grads) with 1 process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "two.pt")
    with spawn_env(2):
        mp.start_processes(
            _worker, args=(port, method, args, out), nprocs=2, start_method=start_method()
        )
    return torch.load(out, weights_only=True), _step(method, args, slice(0, N))


def assert_same_gradients(g1: dict, g2: dict, rel: float = 1e-5) -> None:
    """Per tensor: max |g2 − g1| ≤ rel · max |g1| (float summation order differs by process)."""
    assert set(g1) == set(g2)
    for k in g1:
        scale = float(g1[k].abs().max())
        assert float((g2[k] - g1[k]).abs().max()) <= rel * scale + 1e-9, k


def without_key_bias(weights: dict) -> dict:
    """Weights with the key part of each attention `in_proj_bias` ([q | k | v]) removed.

    Adding b_k to every key adds q·b_k to a whole row of attention logits, which the softmax
    ignores: its true gradient is 0, so it moves only by float noise, which Adam scales up to
    learning-rate-sized steps, differently in 1 and 2 processes. Everything else is compared.
    """
    out = {}
    for k, v in weights.items():
        if k.endswith("attn.in_proj_bias"):
            n = v.numel() // 3
            v = torch.cat([v[:n], v[2 * n :]])
        out[k] = v
    return out


def buffer_holding(positions, size: int = 16):
    """A replay buffer whose task `t0` holds `positions`; t0's stand-in training entries give
    position p the packed sample id p, so a batch row's `sid` is its position (no shard)."""
    import numpy as np

    from cvl.data.index import Entries
    from cvl.methods.buffers import Buffer

    t0 = Entries.of_ids(np.arange(max(positions) + 1, dtype=np.int64))
    b = Buffer(size, entries_of={"t0": t0}.__getitem__)
    b.items = {"t0": np.array(positions, dtype=np.int64)}
    return b
