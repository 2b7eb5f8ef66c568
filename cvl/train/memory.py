"""Memory of a training stage for `--budget maf` (`cvl.train.budget`): three measures.

- `device` (FoMo-in-Flux's; CUDA): the device's used memory as `nvidia-smi` reports it
  (`torch.cuda.mem_get_info`: total − free; the CUDA context, the caching allocator's reserve,
  and other processes on the device included), read after the stage, the allocator's cache
  emptied before it. FoMo-in-Flux's `memory_computation.py` (`get_gpu_memory`, `nvidia-smi
  --query-gpu=memory.used`) reads it after each stage of a method (begin_task, a forward +
  backward + update step, end_task) in a process of its own and keeps the largest; in cvl's one
  process the tensors that are not the stage's (the training model and the method's state,
  while the full fine-tuning reference runs on a copy) are taken out (`exclude`).
- `tensors` (device-independent; the default on the CPU, where there is no device memory):
  the bytes the step holds — every tensor of the model and of the method (old, momentum and
  teacher models, importance weights, the buffer's stored outputs), the gradients and the
  optimizer's two moments of what trains, and the activations autograd saves for the backward
  (`torch.autograd.graph.saved_tensors_hooks`, the largest micro-batch's), each storage once;
  under `--accum-mode cached` also what the step holds across its micro-batches (every
  micro-batch's inputs, the step's outputs and their gradients: `StageMemory.hold`), the
  largest of the loss pass's and each second-pass forward's activations being the saved part.
  Exact and the same on every machine; transient buffers of a kernel are not in it.
- `allocated` (cvl's earlier measure): CUDA `max_memory_allocated` over the stage plus the
  optimizer's moments; on the CPU the process's peak resident set (`cvl.train.cost`), which
  libraries dominate for small models and which never decreases within a process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from cvl.errors import CvlError

MEASURES = ("device", "tensors", "allocated")


def resolve_measure(name: str, device: torch.device) -> str:
    """`auto` → `device` on CUDA, `tensors` elsewhere; `device` needs CUDA."""
    if name == "auto":
        return "device" if device.type == "cuda" else "tensors"
    if name == "device" and device.type != "cuda":
        raise CvlError(
            "--budget-arg memory=device reads CUDA device memory (as FoMo-in-Flux's nvidia-smi); "
            f"on {device.type} use memory=tensors (or memory=allocated)"
        )
    return name


def _key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device, s.data_ptr())


def tensor_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages of `tensors` (each counted once; `seen` is extended)."""
    seen = set() if seen is None else seen
    n = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        k = _key(t)
        if k in seen:
            continue
        seen.add(k)
        n += t.untyped_storage().nbytes()
    return n


def held_tensors(obj: Any, _seen: set | None = None) -> Iterator[torch.Tensor]:
    """Tensors an object holds: its modules' parameters and buffers, tensors in its attributes,
    dicts, lists and tuples, and those of nested methods (`Wrapper.inner`) and buffers."""
    from cvl.methods.base import Method
    from cvl.methods.buffers import Buffer

    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from held_tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from held_tensors(v, seen)
    elif isinstance(obj, (Method, Buffer)):
        for v in vars(obj).values():
            yield from held_tensors(v, seen)


def trainable(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in params if p.requires_grad]


class SavedActivations:
    """Bytes autograd saves for the backward inside the context (storages not in `resident`),
    per micro-batch: call `micro_done()` after each backward; `peak` is the largest."""

    def __init__(self, resident: set) -> None:
        self.resident = resident
        self.current = 0
        self.peak = 0
        self._seen: dict = {}  # storage -> bytes, this micro-batch's

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            k = _key(t)
            if k not in self.resident and k not in self._seen:
                self._seen[k] = t.untyped_storage().nbytes()
                self.current += self._seen[k]
        return t

    def release(self, keys: Iterable[tuple]) -> None:
        """Storages counted elsewhere (`StageMemory.hold`): out of this micro-batch's bytes."""
        for k in keys:
            self.current -= self._seen.pop(k, 0)

    def micro_done(self) -> None:
        self.peak = max(self.peak, self.current)
        self.current = 0
        self._seen = {}

    @contextlib.contextmanager
    def watching(self) -> Iterator[SavedActivations]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
        self.micro_done()


class StageMemory:
    """Memory of one stage (a step of the method, the full fine-tuning reference step, the
    end-of-task work) under `measure` (module doc).

    `owned`: the tensors of the stage (its model, the method and buffer it trains with);
    `trained`: the parameters it updates (gradients and two optimizer moments are counted
    for them under `tensors`; the moments are added under `allocated`, and under `device` for a
    stage without an update, `moments_allocated` False); `exclude_live`: under `device`, take the tensors alive
    before the stage and not in `owned` out of the reading (module doc).
    """

    def __init__(
        self,
        measure: str,
        device: torch.device,
        owned: Iterable[torch.Tensor],
        trained: list[torch.Tensor],
        moments_allocated: bool,
        exclude_live: bool = False,
    ) -> None:
        self.measure, self.device = measure, device
        self.owned = list(owned)
        self.trained = trained
        self.moments_allocated = moments_allocated
        self.exclude_live = exclude_live
        self.saved: SavedActivations | None = None
        self.held = 0  # `hold`: bytes kept across micro-batches (`tensors`)
        self.value = 0

    def moments(self) -> int:
        return 2 * sum(p.numel() * p.element_size() for p in self.trained)

    def __enter__(self) -> StageMemory:
        from cvl.train.cost import reset_peak_memory

        if self.measure == "device":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            live = torch.cuda.memory_allocated(self.device)
            mine = tensor_bytes(t for t in self.owned if t.device.type == "cuda")
            self._exclude = max(0, live - mine) if self.exclude_live else 0
        elif self.measure == "allocated":
            reset_peak_memory(self.device)
        else:
            resident: set = set()
            self._resident_bytes = tensor_bytes(self.owned, resident)
            self.saved = SavedActivations(resident)
            self._ctx = self.saved.watching()
            self._ctx.__enter__()
        return self

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """`tensors` are held across the stage's micro-batches (cached accumulation's inputs
        and outputs), those that require grad with a gradient of their size: under `tensors`
        counted once (the largest such set) and not again as saved activations."""
        if self.saved is None:
            return
        tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
        seen = set(self.saved.resident)
        n = tensor_bytes(tensors, seen)
        n += sum(t.numel() * t.element_size() for t in tensors if t.requires_grad)
        self.saved.release(seen - self.saved.resident)
        self.saved.resident |= seen
        self.held = max(self.held, n)

    def micro_done(self) -> None:
        """A micro-batch's backward finished (`tensors`: its saved activations are freed)."""
        if self.saved is not None:
            self.saved.micro_done()

    def backward_done(self) -> None:
        """The stage's backward passes are over (`allocated`: its peak is read here, before
        the optimizer allocates its moments, which are added as computed)."""
        if self.measure == "allocated":
            from cvl.train.cost import peak_memory

            self._peak = peak_memory(self.device)

    def __exit__(self, *exc: Any) -> None:
        from cvl.train.cost import peak_memory

        if self.measure == "device":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self.value = int(total - free) - self._exclude
            if not self.moments_allocated:
                self.value += self.moments()
        elif self.measure == "allocated":
            self.value = getattr(self, "_peak", None) or peak_memory(self.device)
            self.value += self.moments()
        else:
            self._ctx.__exit__(*exc)
            grads = sum(p.numel() * p.element_size() for p in self.trained)
            self.value = self._resident_bytes + grads + self.moments() + self.saved.peak
            self.value += self.held
