"""What a run costs: FLOPs, peak memory, wall time and samples, per task and per run.

**FLOPs** are counted by a dispatch mode with torch's own FLOP formulas
(`torch.utils.flop_counter`'s registry: the matmuls, convolutions and attention kernels, forward
and backward; element-wise ops count zero), plus what the registry lacks: the CPU's fused
attention kernels and the fused inference fast paths of `nn.MultiheadAttention` and
`nn.TransformerEncoderLayer`, which every frozen model (old, teacher, reference, momentum:
eval mode, no autograd) takes in float32 and which hide their matmuls from dispatch modes;
they are counted as the unfused path that training and autocast run, so a frozen forward
counts the same in every precision. `FlopCounterMode` itself also tracks modules and tries
to decompose every unregistered op, several times the overhead; the counts are the same
(tests/test_cost.py).
Counting costs little because it runs rarely:

- **the step**: one optimizer step per task is counted (the first of the task: `before_step`,
  every micro-batch's forward, loss and backward, `after_backward`, the optimizer step,
  `after_step`), so it holds the method's extra passes (old, momentum, reference models,
  IncCLIP's generation). Every step of a task has the same shapes and passes, so the task's
  training FLOPs are steps × that count. The dispatch mode runs the same kernels: a counted
  run's weights equal an uncounted one's bit for bit. With `--compile` the compiled graph
  hides its kernels from dispatch modes, so the step is counted by a probe on the eager model
  (`cvl.train.budget.probe_step`: a step run and undone before the task).
- **the extras**: work outside the steps, wrapped in `extra(ctx, name)`: `before_task`,
  `after_task` (Fisher / importance passes, AFEC's Fisher merge, WiSE's interpolation...),
  the buffer update (k-means / herding features), per-epoch validation (`--select best-val`)
  and work a method marks itself (AFEC's expanded model, trained at each epoch's start). The
  first call of each in a task is counted; later calls of the same extra in that task are taken
  to cost the same (AFEC: an epoch cut short by `--max-steps-per-task` or a budget trains fewer
  expanded steps, so there the figure is an upper bound).

**Peak memory**: on CUDA `torch.cuda.max_memory_allocated` over the task (tensors only: the
caching allocator's reserve and the CUDA context are not in it); on the CPU the process's
peak resident set size (Linux `VmHWM`, reset at the task's start through
/proc/self/clear_refs; elsewhere `ru_maxrss`, the peak since the process started) — all of
the process: Python, libraries, loader buffers, so it is dominated by them for small models.

**Several processes**: counts are summed over ranks (every rank counts its own shard), memory
is given per process (the largest) and summed, wall time is rank 0's, device-hours are wall
time × processes.

Records: task.json "cost" (`CostTracker.task_record`), run.json "cost" (`summarize_run`),
checkpoints carry the counts so far (a resumed task keeps its counted step). Both say which
gradient accumulation the steps ran (`grad_accum`, `accum_mode`: `--accum-mode cached` counts
one more forward per micro-batch, its second pass, in every counted or probed step).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GIGA, TERA = 1e9, 1e12


def _lengths(x: torch.Tensor) -> list[int]:
    """Sequence length of each batch item of a batch-first (B, L, E) tensor, or of a nested
    tensor's components (the fast paths accept both)."""
    if x.is_nested:
        return [int(c.shape[0]) for c in x.unbind()]
    return [int(x.shape[-2])] * (int(x.shape[0]) if x.dim() == 3 else 1)


def _mha_flops(q: torch.Tensor, k: torch.Tensor, e: int) -> int:
    """Multi-head attention of width `e`, as the unfused path computes it: the in-projection
    of the queries and of the keys and values (2·e² per row each, packed or not), QKᵀ and AV
    (2·Lq·Lk·e each per batch item) and the out-projection (2·e² per query row)."""
    lq, lk = _lengths(q), _lengths(k)
    proj = 2 * e * e * (2 * sum(lq) + 2 * sum(lk))
    return proj + 4 * e * sum(a * b for a, b in zip(lq, lk))


def native_mha_flop(query, key, value, embed_dim, *args, out_val=None, **kwargs) -> int:  # noqa: ANN001
    """`aten._native_multi_head_attention`: `nn.MultiheadAttention`'s fused fast path (eval
    mode, no autograd, no autocast: every frozen model's forward). Counted as the ops the
    unfused path runs (`F.multi_head_attention_forward`), so a frozen forward counts the same
    in every precision (autocast and training take the unfused path)."""
    return _mha_flops(query, key, int(embed_dim))


def native_encoder_layer_flop(src, embed_dim, *args, out_val=None, **kwargs) -> int:  # noqa: ANN001
    """`aten._transformer_encoder_layer_fwd` (`nn.TransformerEncoderLayer`'s fast path):
    self-attention as `native_mha_flop` plus the MLP's two matmuls (2·e·f per row each)."""
    ffn1 = kwargs.get("ffn_weight_1", args[12] if len(args) > 12 else None)
    f = int(ffn1.shape[0]) if ffn1 is not None else 0
    rows = sum(_lengths(src))
    return _mha_flops(src, src, int(embed_dim)) + 4 * rows * int(embed_dim) * f


for _f in (native_mha_flop, native_encoder_layer_flop):
    _f._get_raw = True  # takes the tensors, not their shapes (FlopCounterMode's convention)


def _formulas() -> dict[Any, Any]:
    """torch's FLOP formulas by op packet, plus what its registry lacks: the CPU
    flash-attention kernels (same shapes and FLOPs as the CUDA flash kernels torch registers)
    and the fused inference fast paths of `nn.MultiheadAttention` and
    `nn.TransformerEncoderLayer` (their kernels call the matmuls below the dispatcher, where
    no dispatch mode sees them)."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    reg = dict(flop_registry)
    fused = {
        "_native_multi_head_attention": native_mha_flop,
        "_transformer_encoder_layer_fwd": native_encoder_layer_flop,
    }
    for name, f in fused.items():
        if hasattr(aten, name):
            reg[getattr(aten, name)] = f
    cpu = {
        "_scaled_dot_product_flash_attention_for_cpu": aten._scaled_dot_product_flash_attention,
        "_scaled_dot_product_flash_attention_for_cpu_backward": (
            aten._scaled_dot_product_flash_attention_backward
        ),
    }
    for name, like in cpu.items():
        if hasattr(aten, name) and like in reg:
            reg[getattr(aten, name)] = reg[like]
    if hasattr(aten, "_addmm_activation"):  # addmm fused with GELU/ReLU (CUDA linear + act)
        reg[aten._addmm_activation] = reg[aten.addmm]
    return reg


_FORMULAS: dict[Any, Any] | None = None


def formulas() -> dict[Any, Any]:
    """The FLOP formulas the meter uses (for `FlopCounterMode(custom_mapping=...)` too)."""
    global _FORMULAS
    if _FORMULAS is None:
        _FORMULAS = _formulas()
    return _FORMULAS


class _Mode(TorchDispatchMode):
    """Runs every op unchanged and adds the FLOPs of registered ones to the meter's bucket."""

    def __init__(self, meter: FlopMeter) -> None:
        super().__init__()
        self.meter = meter
        self.reg = formulas()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        f = self.reg.get(func._overloadpacket)
        if f is not None and self.meter.buckets:
            key = self.meter.buckets[-1]
            if key is not None:
                n = int(f(*args, **kwargs, out_val=out))
                self.meter.counts[key] = self.meter.counts.get(key, 0) + n
        return out


class FlopMeter:
    """FLOPs per named bucket; `counting(name)` counts the ops run inside it into `name`
    (None: run them uncounted, e.g. a repeated extra inside a counted step). Nestable."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.buckets: list[str | None] = []
        self._mode: _Mode | None = None

    def push(self, name: str | None) -> None:
        if not self.buckets:
            self._mode = _Mode(self)
            self._mode.__enter__()
        self.buckets.append(name)

    def pop(self) -> None:
        self.buckets.pop()
        if not self.buckets and self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def close(self) -> None:
        """Leave the dispatch mode whatever is open (an exception inside a counted region)."""
        while self.buckets:
            self.pop()

    @contextlib.contextmanager
    def counting(self, name: str | None) -> Iterator[None]:
        self.push(name)
        try:
            yield
        finally:
            self.pop()


def count_flops(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """(FLOPs, result) of `fn(*args, **kwargs)` on this process (tests, benchmarks)."""
    m = FlopMeter()
    with m.counting("x"):
        r = fn(*args, **kwargs)
    return m.counts.get("x", 0), r


# -- memory ------------------------------------------------------------------------------------
_STATUS = Path("/proc/self/status")


def _vm_hwm() -> int | None:
    try:
        m = re.search(r"VmHWM:\s+(\d+)\s*kB", _STATUS.read_text())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def reset_peak_memory(device: torch.device) -> str:
    """Start a new peak; returns what `peak_memory` will measure on this device."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return "CUDA max_memory_allocated (tensors)"
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to the current RSS
        if _vm_hwm() is not None:
            return "peak resident set size of the process (VmHWM)"
    except OSError:
        pass
    return "peak resident set size since the process started (ru_maxrss)"


def peak_memory(device: torch.device) -> int:
    """Bytes: the peak since `reset_peak_memory` (see its measure)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def optimizer_state_bytes(params: list[torch.Tensor]) -> int:
    """What AdamW / LAMB keep per trainable parameter: two moments of its size and dtype."""
    return 2 * sum(p.numel() * p.element_size() for p in params if p.requires_grad)


# -- per task ------------------------------------------------------------------------------------
def reduce_values(values: list[float], op: str, device: torch.device) -> list[float]:
    """All-reduce a few numbers across ranks (sum or max); identity on one process."""
    from cvl.dist import world_size

    if world_size() <= 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist_op = torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
    torch.distributed.all_reduce(t, op=dist_op)
    return t.tolist()


class CostTracker:
    """The loop's cost bookkeeping: one counted step and the extras of each task, its peak
    memory and wall time; `state()` goes into checkpoints, `task_record()` into task.json.

    Counts of this session are per rank until a record or a checkpoint reduces them (one
    all-reduce); what earlier sessions counted arrives reduced (`carried`).
    """

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled
        self.meter = FlopMeter()
        self.probing = False
        self._task: dict[str, Any] | None = None

    # -- task lifecycle ----------------------------------------------------------------------
    def begin_task(self, saved: dict[str, Any] | None = None) -> None:
        """A task starts (`saved`: the cost state of its mid-task checkpoint, if resuming)."""
        self.meter.close()
        self.meter.counts = {}
        s = dict(saved or {})
        self._task = {
            "carried": s,  # reduced counts of earlier sessions (step, extras, calls)
            "calls": {},  # extra -> calls this session (counted or not)
            "t0": time.perf_counter(),
            "measure": reset_peak_memory(self.device),
            "step_source": s.get("step_counted_on"),
            "peak_floor": 0,  # peaks seen before a probe restarted the measurement
        }

    @property
    def has_step(self) -> bool:
        """True once this task's step cost is known (counted, probed or carried)."""
        t = self._task or {}
        return "step" in self.meter.counts or t.get("carried", {}).get("flops_per_step") is not None

    def start_step(self, source: str = "the task's first step") -> None:
        """Count the optimizer step that starts now (until `stop_step`)."""
        if self.enabled and self._task is not None:
            self._task["step_source"] = source
            self.meter.push("step")

    def stop_step(self) -> None:
        if self.meter.buckets and self.meter.buckets[-1] == "step":
            self.meter.pop()

    def abort(self) -> None:
        """Leave any counted region (the task stopped by an exception)."""
        self.meter.close()

    @contextlib.contextmanager
    def extra(self, name: str, skip: bool = False) -> Iterator[None]:
        """Count `name`'s FLOPs the first time it runs in this task (see the module doc);
        `skip`: work redone on resume (already counted before the interruption)."""
        t = self._task
        if not self.enabled or t is None or skip:
            yield
            return
        if self.probing:  # the probe measures the step only; its extras are thrown away
            with self.meter.counting(None) if self.meter.buckets else contextlib.nullcontext():
                yield
            return
        key = "extra:" + name
        first = key not in self.meter.counts and name not in t["carried"].get("extras", {})
        if not first:
            t["calls"][name] = t["calls"].get(name, 0) + 1
            with self.meter.counting(None) if self.meter.buckets else contextlib.nullcontext():
                yield
            return
        t["calls"][name] = t["calls"].get(name, 0) + 1
        self.meter.counts.setdefault(key, 0)
        with self.meter.counting(key):
            yield

    def keep_peak(self) -> None:
        """Fold the task's peak so far into the record before a probe resets the counter."""
        if self.enabled and self._task is not None:
            self._task["peak_floor"] = max(self._task["peak_floor"], peak_memory(self.device))

    def set_step(self, flops_global: int, source: str) -> None:
        """A step cost measured elsewhere (the probe), already summed over ranks."""
        if self._task is not None:
            self._task["carried"]["flops_per_step"] = int(flops_global)
            self._task["step_source"] = source
            self.meter.counts.pop("step", None)

    # -- records -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The task's counts so far, summed over ranks (collective: every rank calls it)."""
        t = self._task
        if t is None:
            return {}
        c = t["carried"]
        names = sorted(set(c.get("extras", {})) | set(t["calls"]))
        peak = float(max(peak_memory(self.device), t["peak_floor"])) if self.enabled else 0.0
        local = [float(self.meter.counts.get("step", 0))]
        local += [float(self.meter.counts.get("extra:" + n, 0)) for n in names]
        summed = reduce_values(local + [peak], "sum", self.device)
        psum, summed = summed[-1], summed[:-1]
        pmax = reduce_values([peak], "max", self.device)[0]
        step = c.get("flops_per_step")
        if "step" in self.meter.counts:
            step = int(summed[0])
        extras = {}
        for n, v in zip(names, summed[1:]):
            old = c.get("extras", {}).get(n, {})
            extras[n] = {
                "flops_per_call": int(old.get("flops_per_call", 0) + v),
                "calls": int(old.get("calls", 0) + t["calls"].get(n, 0)),
            }
        return {
            "flops_per_step": step,
            "step_counted_on": t["step_source"],
            "extras": extras,
            "peak_memory_bytes": int(max(pmax, c.get("peak_memory_bytes", 0))),
            "peak_memory_total_bytes": int(max(psum, c.get("peak_memory_total_bytes", 0))),
            "memory_measure": t["measure"],
            "wall_s": float(c.get("wall_s", 0.0)) + time.perf_counter() - t["t0"],
        }

    def task_record(
        self, steps: int, samples_per_step: int, processes: int, accumulation: dict | None = None
    ) -> dict[str, Any]:
        """task.json's "cost" of the finished task (collective); `accumulation`: which
        gradient accumulation the steps ran (`accumulation_record`)."""
        st = self.state()
        self.meter.close()
        fps = st["flops_per_step"]
        train = fps * steps if fps is not None else None
        extras = {
            n: {**e, "flops": e["flops_per_call"] * e["calls"]} for n, e in st["extras"].items()
        }
        extra = sum(e["flops"] for e in extras.values())
        rec = {
            "flops_per_step": fps,
            "step_counted_on": st["step_counted_on"] if fps is not None else None,
            "steps": steps,
            "samples": steps * samples_per_step,
            "train_flops": train,
            "extras": extras,
            "extra_flops": extra,
            "total_flops": (train or 0) + extra,
            "peak_memory_bytes": st["peak_memory_bytes"],
            "peak_memory_total_bytes": st["peak_memory_total_bytes"],
            "memory_measure": st["memory_measure"],
            "wall_s": round(st["wall_s"], 3),
            "processes": processes,
            "device_hours": st["wall_s"] * processes / 3600,
            **(accumulation or {}),
        }
        self._task = None
        return rec


def accumulation_record(cfg: Any) -> dict[str, Any]:
    """Which gradient accumulation a task's steps ran (its cost depends on it: cached mode
    runs every forward twice): `grad_accum` K and `accum_mode`, the mode the steps trained
    (`cached` only with K > 1: `--accum-mode cached` with K = 1 is a plain step)."""
    from cvl.train.accum import is_cached

    return {
        "grad_accum": int(cfg.grad_accum),
        "accum_mode": "cached" if is_cached(cfg) else "plain",
    }


def extra(ctx: Any, name: str) -> contextlib.AbstractContextManager:
    """For methods: count `name` as a per-task extra of the training loop running `ctx`
    (a no-op outside one)."""
    tracker = getattr(getattr(ctx, "services", None), "cost", None)
    return tracker.extra(name) if tracker is not None else contextlib.nullcontext()


# -- runs ---------------------------------------------------------------------------------------
#: task.json "cost" keys saying which accumulation ran; run.json "cost" gives the tasks' value
ACCUMULATION = ("grad_accum", "accum_mode")
RUN_TOTALS = ("total_flops", "train_flops", "extra_flops", "samples", "wall_s", "device_hours")


def summarize_run(run: str | Path) -> dict[str, Any]:
    """run.json's "cost": totals over the finished tasks' task.json (tasks trained before cost
    was recorded are counted in `tasks_without_cost`)."""
    from cvl.io import read_json
    from cvl.runs import finished_tasks

    out: dict[str, Any] = {k: 0 for k in RUN_TOTALS}
    out.update(peak_memory_bytes=0, tasks=0, tasks_without_cost=0, memory_measure=None)
    seen: dict[str, list] = {k: [] for k in ACCUMULATION}
    for c in finished_tasks(run):
        f = c.path / "task.json"
        cost = (read_json(f) if f.is_file() else {}).get("cost")
        if not cost:
            out["tasks_without_cost"] += 1
            continue
        out["tasks"] += 1
        for k in RUN_TOTALS:
            out[k] += cost.get(k) or 0
        out["peak_memory_bytes"] = max(out["peak_memory_bytes"], cost.get("peak_memory_bytes", 0))
        out["memory_measure"] = out["memory_measure"] or cost.get("memory_measure")
        for k in ACCUMULATION:  # tasks recorded before accumulation was: not counted
            if k in cost and cost[k] not in seen[k]:
                seen[k].append(cost[k])
    for k, vals in seen.items():  # the tasks' value, or their values when they differ
        out[k] = vals[0] if len(vals) == 1 else (vals or None)
    out["wall_s"] = round(out["wall_s"], 3)
    return out


def human(n: float | None, unit: str = "FLOPs") -> str:
    """1.23 TFLOPs, 45.6 GFLOPs, 1.2 GB ... (None: '–')."""
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "–"
    for p, s in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= p:
            return f"{n / p:.3g} {s}{unit}"
    return f"{n:.3g} {unit}"


def describe(cost: dict[str, Any]) -> str:
    """One line for `cvl info`: a task's (or a run's) cost."""
    parts = [f"{human(cost.get('total_flops'))}"]
    if cost.get("flops_per_step") is not None:
        parts[0] += (
            f" ({cost['steps']} steps × {human(cost['flops_per_step'])}"
            f" + extras {human(cost.get('extra_flops', 0))})"
        )
    elif "train_flops" in cost and "tasks" in cost:
        parts[0] += (
            f" (training {human(cost['train_flops'])} + extras {human(cost['extra_flops'])})"
        )
    parts.append(f"peak memory {human(cost.get('peak_memory_bytes'), 'B')}")
    parts.append(f"{cost.get('wall_s', 0):.1f} s")
    parts.append(f"{cost.get('device_hours', 0):.3g} device-hours")
    parts.append(f"{cost.get('samples', 0)} samples")
    if cost.get("accum_mode") is not None:  # which accumulation the steps ran
        parts.append(f"--grad-accum {cost.get('grad_accum')} --accum-mode {cost['accum_mode']}")
    return ", ".join(parts)
