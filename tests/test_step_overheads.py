"""What keeps a fast GPU fed during a method's step (issue 27): no host syncs, one gather per
tensor, frozen models in the training precision, gradients reduced during the backward.

- Host syncs, CPU: every trained method (and the fusion model's MLM paths) trains 2 tasks × 2
  steps under a `TorchDispatchMode` that flags the ops which make the host wait for a GPU
  (a tensor read as a Python number, `nonzero`, boolean-mask indexing, `unique`, `equal`,
  `tolist`, `cpu`, `numpy`) while a method's per-step hook runs (before_step, loss, backward
  of its terms, after_backward, after_step), and every tensor read anywhere in the step, the
  loop's own included, between log points (issue 45: the non-finite guard reads its flags
  with the log line's values): zero per step. Per-task work (before_task, after_task), log
  lines and checkpoints are not the step; nor are the optimizer's own step counters, which
  torch keeps on the CPU for its non-fused implementations.
- Host syncs, CUDA (when torch sees a GPU): the same runs under
  `torch.cuda.set_sync_debug_mode("error")`, which also catches blocking host-to-device copies.
- Gathers, 2 processes (gloo): one loss + backward of each old-model method; no tensor is
  all-gathered twice while it is alive (the memo in `cvl.dist`).
- Precision: with `--precision bf16` (CPU autocast) the frozen models' linear layers (old,
  reference, momentum, teacher) compute in bf16 during the steps, like the training model.
- Gradient reduction, 2 processes: `GradReducer` gives `average_gradients`' result (bitwise
  with 2 ranks) with gradient accumulation, unused (no gradient: None) and rank-dependent
  parameters, extra parameters, several buckets, a skipped step and a parameter reached twice
  in a backward, and sends buckets while the backward runs.
"""

from __future__ import annotations

import gc
import json
import socket
import sys
import weakref
from pathlib import Path

import pytest
import torch
from reliability_helpers import method_args, trained_methods
from torch.utils._python_dispatch import TorchDispatchMode

import cvl
import cvl.dist

CVL_ROOT = Path(cvl.__file__).resolve().parent
STEP_HOOKS = {"before_step", "loss", "after_backward", "after_step"}
# CPU-side by construction (on a GPU run these tensors are on the CPU too: not a GPU sync).
ALLOWED = {
    # the reference pairs are read and decoded on the CPU; indices from a CPU generator
    ("methods/zscl.py", "ref_batch"),
    # the memory's token ids live on the CPU (pooled_length of the mixtures, before the copy)
    ("models/text_embeds.py", "pooled_length"),
    # not per step: AFEC's expanded model trains its own epoch once per epoch (CPU-read data,
    # its optimizer's CPU step counters, its epoch loss read once)
    ("methods/afec.py", "_expanded_epoch"),
    # the loader's samples and batches (in its worker processes on a real run; here, with
    # --workers 0, in this one): decoded, cropped and collated on the host
    ("data/reader.py", "__getitem__"),
    ("data/reader.py", "__getitems__"),  # a worker's whole batch
    ("data/reader.py", "collate"),
}
aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense,  # .item(), float(t), int(t), bool(t)
    aten.nonzero,
    aten.masked_select,
    aten.unique_consecutive,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.equal,
    aten.is_nonzero,
}


def _cvl_frames():
    """(path relative to cvl/, function) of the cvl frames on the stack, innermost first."""
    f = sys._getframe(1)
    out = []
    while f is not None:
        p = Path(f.f_code.co_filename)
        if p.is_relative_to(CVL_ROOT):
            out.append((p.relative_to(CVL_ROOT).as_posix(), f.f_code.co_name, f.f_lineno))
        f = f.f_back
    return out


class SyncDetector(TorchDispatchMode):
    """Records GPU-sync-making ops run inside a method's per-step hook (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()
        self.in_backward = False
        self.in_step = False  # from a step's start to the next log line

    def note(self, what: str) -> None:
        frames = _cvl_frames()
        in_hook = any(p.startswith("methods/") and fn in STEP_HOOKS for p, fn, _ in frames)
        if not (in_hook or self.in_backward or self.in_step):
            return
        if any((p, fn) in ALLOWED for p, fn, _ in frames) or _optimizer_counter():
            return
        where = next((f"{p}:{ln} ({fn})" for p, fn, ln in frames), "outside cvl")
        self.found.add(f"{what} at {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            self.note(str(packet))
        elif packet in (aten.index, aten.index_put, aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] if len(args) > 1 else ()) or ()
        ):
            self.note(f"boolean-mask {packet}")
        elif packet is aten.repeat_interleave and kwargs.get("output_size") is None:
            self.note("repeat_interleave without output_size")
        return func(*args, **kwargs)


def _optimizer_counter() -> bool:
    """A read by torch's non-fused optimizers of their step counter (a CPU tensor on a GPU
    run too: `capturable=False`)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/torch/optim/" in name and f.f_code.co_name in ("_get_value", "_get_scalar_dtype"):
            return True
        f = f.f_back
    return False


def _tiny_stream(root: Path) -> Path:
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    spec = SynthSpec(tasks=2, per_task=16, test_per_task=4, val_per_task=4, overlap=0, seed=0)
    build_synthetic(root, spec, progress=False)
    return root


def _argv(stream: Path, out: Path, method: str, model: str, *extra: str) -> list[str]:
    return [
        "train",
        *("--stream", str(stream), "--out", str(out), "--method", method),
        *method_args(method, stream),
        *("--model", model, "--model-config", "tiny-vit" if model == "clip" else "tiny"),
        *("--epochs", "1", "--batch-size", "8", "--max-steps-per-task", "2"),
        *("--checkpoint-every", "0", "--log-with", "none", "--quiet", "--workers", "0"),
        *extra,
    ]


# every trained method on the clip model; the fusion model's MLM and MLM-distillation paths
RUNS = [(m, "clip") for m in trained_methods()] + [
    (m, "fusion") for m in ("seqft", "ctp", "lwf", "lucir")
]


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return _tiny_stream(tmp_path_factory.mktemp("syncs") / "s")


def _train_detecting(argv: list[str], monkeypatch) -> set[str]:
    """Run `cvl train` in this process with the detector on; what it found in method steps."""
    import cvl.train.loop as loop
    from cvl.cli import main

    det = SyncDetector()
    real_backward = loop.GradReducer.prepare

    def prepare(self, params, last):  # right before each backward of the step
        det.in_backward = True
        return real_backward(self, params, last)

    real_finish = loop.GradReducer.finish

    def finish(self, params):
        det.in_backward = False
        return real_finish(self, params)

    monkeypatch.setattr(loop.GradReducer, "prepare", prepare)
    monkeypatch.setattr(loop.GradReducer, "finish", finish)
    real_begin, real_flush = loop.LogWindow.begin_step, loop.Trainer._flush_log

    def begin_step(self, *a, **k):  # a step starts (its first micro-batch is loaded)
        det.in_step = True
        return real_begin(self, *a, **k)

    def flush_log(self, *a, **k):  # a log point: the window's one read is allowed here
        det.in_step = False
        return real_flush(self, *a, **k)

    monkeypatch.setattr(loop.LogWindow, "begin_step", begin_step)
    monkeypatch.setattr(loop.Trainer, "_flush_log", flush_log)
    for name in ("tolist", "cpu", "numpy"):  # reads that do not dispatch an op on the CPU
        real = getattr(torch.Tensor, name)

        def read(self, *a, _real=real, _name=name, **k):
            det.note(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)
    with det:
        assert main(argv) in (0, None)
    return det.found


@pytest.mark.slow
@pytest.mark.parametrize("method,model", RUNS, ids=[f"{m}-{k}" for m, k in RUNS])
def test_method_step_makes_no_host_sync(method, model, stream, tmp_path, monkeypatch):
    found = _train_detecting(_argv(stream, tmp_path / "run", method, model), monkeypatch)
    assert not found, f"{method}/{model}: host syncs in the step: {sorted(found)}"


def test_the_detector_catches_a_sync_in_a_method_step(stream, tmp_path, monkeypatch):
    """The check above can fail: Mod-X's row test read back as a Python bool is caught."""
    import cvl.methods.modx as modx

    real = modx.row_correct

    def row_correct(logits, targets):
        ok = real(logits, targets)
        bool(ok.all())  # what a data-dependent branch on a tensor would do
        return ok

    monkeypatch.setattr(modx, "row_correct", row_correct)
    found = _train_detecting(_argv(stream, tmp_path / "run", "modx", "clip"), monkeypatch)
    assert any("_local_scalar_dense" in f and "methods/modx.py" in f for f in found), found


def test_the_detector_catches_the_loops_own_read_between_log_points(stream, tmp_path, monkeypatch):
    """The step's own reads count too: the finiteness read the guard made before every
    backward until issue 45 (`bool(torch.isfinite(loss))`) is caught, once per step."""
    import cvl.train.loop as loop

    real = loop.Trainer._backward

    def backward(self, loss):
        bool(torch.isfinite(loss.detach()))
        return real(self, loss)

    monkeypatch.setattr(loop.Trainer, "_backward", backward)
    found = _train_detecting(_argv(stream, tmp_path / "run", "seqft", "clip"), monkeypatch)
    step = (("train/loop.py", "_train_task"), ("train/accum.py", "accumulate"))  # its backward
    assert any(a in f and b in f for f in found for a, b in step), found


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method,model", RUNS, ids=[f"{m}-{k}" for m, k in RUNS])
def test_method_step_makes_no_cuda_sync(method, model, stream, tmp_path, monkeypatch):
    """On a GPU: the method's hooks and the backward run under sync debug mode "error"."""
    import cvl.train.loop as loop
    from cvl.cli import main
    from cvl.methods.registry import get_method

    def guarded(fn):
        def wrapped(*a, **k):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return wrapped

    cls = get_method(method)
    for h in STEP_HOOKS:
        monkeypatch.setattr(cls, h, guarded(getattr(cls, h)))
    real_prepare, real_finish = loop.GradReducer.prepare, loop.GradReducer.finish

    def prepare(self, params, last):  # from here to finish(): the backward
        real_prepare(self, params, last)
        torch.cuda.set_sync_debug_mode("error")

    def finish(self, params):
        torch.cuda.set_sync_debug_mode("default")
        real_finish(self, params)

    monkeypatch.setattr(loop.GradReducer, "prepare", prepare)
    monkeypatch.setattr(loop.GradReducer, "finish", finish)
    real_svd = torch.linalg.svd

    def svd(*a, **k):  # GeoDL's SVDs: torch documents that they synchronise (cuSOLVER's info)
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real_svd(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(torch.linalg, "svd", svd)
    try:
        assert main(_argv(stream, tmp_path / "run", method, model)) in (0, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- 2 processes: gathers once per tensor, gradient reduction during the backward -------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reducer_checks(rank: int) -> None:
    """GradReducer vs average_gradients on the same model, inputs and micro-batches."""
    from torch.utils.checkpoint import checkpoint

    from cvl.dist import GradReducer, average_gradients

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)
            self.unused = torch.nn.Linear(3, 3)  # never reached: None on every rank
            self.only0 = torch.nn.Parameter(torch.ones(4))  # reached on rank 0 only

        def forward(self, x: torch.Tensor, twice: bool) -> torch.Tensor:
            h = self.a(x).tanh()
            if twice:  # a re-entrant checkpoint reaches `a` a second time in one backward
                xr = x.detach().requires_grad_()  # (a re-entrant checkpoint needs one)
                h = h + checkpoint(lambda t: self.a(t).tanh(), xr, use_reentrant=True)
            y = self.b(h)
            return y * self.only0 if rank == 0 else y

    torch.manual_seed(0)
    nets = [Net(), Net()]
    nets[1].load_state_dict(nets[0].state_dict())
    extra = [torch.nn.Parameter(torch.full((4,), 0.5)) for _ in nets]  # method-owned
    params = [list(n.parameters()) + [e] for n, e in zip(nets, extra)]
    reducer = GradReducer(bucket_mb=1e-4)  # ~100 bytes: one bucket per parameter or two
    sends = []
    real_send = cvl.dist._Bucket.send

    def send(bucket):
        sends.append(bucket)
        real_send(bucket)

    cvl.dist._Bucket.send = send  # a spawned process: restored when it exits
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    for step, (accum, skip, twice) in enumerate(
        [(2, False, False), (1, True, False), (1, False, False), (2, False, True)]
    ):
        xs = [torch.randn(5, 6, generator=g) for _ in range(accum)]
        sends.clear()
        for k, (net, e, ps) in enumerate(zip(nets, extra, params)):
            for m, x in enumerate(xs):
                last = m == accum - 1 and not skip
                if k == 1:
                    reducer.prepare(ps, last)
                ((net(x, twice) * e).square().sum() / accum).backward()
                if k == 1 and last and step > 0 and rank == 0:
                    # after the first step the buckets follow the order gradients arrive in
                    # (rank 0's): all but the never-reached parameters' went out during the
                    # backward (rank 1 waits for `only0`, which it never reaches, from there)
                    assert reducer.sent_in_backward >= len(reducer.buckets) - 1, step
            if skip:
                continue
            if k == 0:
                average_gradients(ps)
            else:
                reducer.finish(ps)
        if twice:  # `a`'s bucket was complete before its second gradient came: sent again
            assert len(sends) > len(reducer.buckets), (len(sends), len(reducer.buckets))
        if not skip:
            for p0, p1 in zip(*params):
                assert (p0.grad is None) == (p1.grad is None)
                assert p0.grad is None or torch.equal(p0.grad, p1.grad), step
            for net in nets:  # no rank reached `unused`: no gradient (as DDP, as 1 process)
                assert all(p.grad is None for p in net.unused.parameters()), step
                assert net.only0.grad is not None  # reached on rank 0: averaged on both
        for ps in params:
            for p in ps:
                p.grad = None
    assert reducer.buckets and len(reducer.buckets) > 2  # several buckets, rebuilt after step 0


class _Recorder:
    """Patches torch.distributed.all_gather: which live tensors were gathered twice."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.real, self.dist = dist.all_gather, dist
        self.seen: dict[tuple, weakref.ref] = {}
        self.dups: list[tuple] = []
        self.calls = 0

    def __call__(self, parts, x, *a, **k):
        sig = (
            x.untyped_storage().data_ptr(),
            x.storage_offset(),
            tuple(x.shape),
            x.stride(),
            x.dtype,
            x._version,
        )
        prev = self.seen.get(sig)
        if prev is not None and prev() is not None:
            self.dups.append(sig[2])
        self.seen[sig] = weakref.ref(x)
        self.calls += 1
        return self.real(parts, x, *a, **k)

    def __enter__(self):
        self.dist.all_gather = self
        return self

    def __exit__(self, *exc):
        self.dist.all_gather = self.real


def _gather_checks(rank: int) -> dict[str, tuple[int, list]]:
    """One loss + backward of each old-model method: (all_gather calls, tensors gathered twice)."""
    from types import SimpleNamespace

    import torch.nn.functional as F
    from distill_helpers import _setup, buffer_holding

    from cvl.methods.der import IMAGE, TEXT

    rows = slice(rank * 8, (rank + 1) * 8)
    buf = buffer_holding([1, 5, 6, 11, 12])
    out: dict[str, tuple[int, list]] = {}
    cases = [
        ("lwf", "lwf", {}),
        ("lwf-logits", "lwf", {"variant": "logits"}),
        ("modx", "modx", {}),
        ("dkr", "dkr", {}),
        ("ctp", "ctp", {}),
        ("co2l", "co2l", {}),
        ("erl", "erl", {}),
        ("der", "der", {}),
        ("derpp", "der", {"derpp": True}),
        ("geodl", "geodl", {"dim": 4}),
    ]
    for name, method, args in cases:
        model, m, ctx, images, texts = _setup(method, args)
        ctx.task_index, ctx.buffer = 1, buf
        ctx.accelerator = SimpleNamespace(
            device=torch.device("cpu"), is_main_process=rank == 0, process_index=rank
        )
        ctx.config = SimpleNamespace(seed=0)
        if method == "ctp":
            old = m.old
            m.setup(ctx)
            m.ref = old
        if method == "der":
            g = torch.Generator().manual_seed(5)
            d = model.embed_dim
            emb = {k: F.normalize(torch.randn(5, d, generator=g), dim=-1) for k in (IMAGE, TEXT)}
            buf.set_payload([("t0", int(p)) for p in buf.items["t0"]], **emb)
        batch = {"image": images[rows], "text": texts[rows], "sid": list(range(16))[rows]}
        with _Recorder() as rec:
            fwd = model(batch["image"], batch["text"])
            terms = m.loss(batch, fwd, ctx)
            sum(terms.values()).backward()
        del fwd, terms
        gc.collect()
        # the memo holds nothing once the gathered tensors are gone
        out[name] = (rec.calls, rec.dups, len(cvl.dist._gathered))
    return out


def _dist_worker(rank: int, port: int, result: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        _reducer_checks(rank)
        gathers = _gather_checks(rank)
        if rank == 0:  # counts and shapes only: plain JSON
            Path(result).write_text(json.dumps(gathers))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_gather_once_and_reduce_during_backward(tmp_path):
    import torch.multiprocessing as mp
    from device_helpers import start_method

    result = str(tmp_path / "gathers.json")
    mp.start_processes(
        _dist_worker, args=(_free_port(), result), nprocs=2, start_method=start_method()
    )
    gathers = json.loads(Path(result).read_text())
    assert set(gathers) >= {"lwf", "modx", "dkr", "ctp", "co2l", "erl", "der", "geodl"}
    for name, (_calls, dups, memo_left) in gathers.items():
        assert not dups, f"{name}: tensors of shape {dups} all-gathered twice in one step"
        assert memo_left == 0, f"{name}: {memo_left} gathers still memoised after the step"
    # the global-batch methods do gather (the check above is not vacuous)
    assert all(gathers[n][0] >= 2 for n in ("modx", "dkr", "ctp", "co2l", "erl", "geodl"))


# -- frozen models compute in the training precision ---------------------------------------------

FROZEN = ["lwf", "modx", "dkr", "ctp", "incclip", "zscl", "co2l", "geodl", "erl", "afc", "lucir"]


@pytest.mark.slow
@pytest.mark.parametrize("method", FROZEN)
def test_frozen_models_run_in_the_training_precision(method, stream, tmp_path):
    """`--precision bf16` (CPU autocast): every linear layer of a frozen model (old, reference,
    momentum, teacher) that runs inside a step hook outputs bf16, as the training model's do.
    IncCLIP's pseudo-text generation (in before_step, outside the loop's autocast block) ran
    in float32 before issue 27."""
    from torch.nn.modules.module import register_module_forward_hook

    from cvl.cli import main

    seen: dict[str, set] = {"frozen": set(), "trained": set()}

    def hook(module, args, output):
        w = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or not isinstance(output, torch.Tensor):
            return
        frames = _cvl_frames()
        if any(p.startswith("methods/") and fn in STEP_HOOKS for p, fn, _ in frames):
            seen["trained" if w.requires_grad else "frozen"].add(output.dtype)

    from accelerate.state import AcceleratorState

    # Accelerate keeps one precision per process: start from a fresh state, and leave one
    AcceleratorState._reset_state()
    handle = register_module_forward_hook(hook)
    try:
        argv = _argv(stream, tmp_path / "run", method, "clip", "--precision", "bf16")
        assert main(argv) in (0, None)
    finally:
        handle.remove()
        AcceleratorState._reset_state()
    assert seen["frozen"] == {torch.bfloat16}, seen
