"""The one training loop, shared by every method (HF Accelerate for processes and precision).

Data: each task's samples (+ the replay buffer's) are a map-style dataset; every epoch's
global batches are a function of (seed, task, epoch) only, and rank r takes slice r of each
global batch, so 2 processes × batch B compute exactly what 1 process × batch 2B does (the
contrastive matrices are built over the gathered global batch, gradients are averaged across
ranks). Each optimizer step re-seeds torch's RNGs (CPU and, on a GPU, every CUDA generator)
and `ctx.generator` from (seed, task, epoch, step, rank), so a resumed run replays the same
randomness without saving RNG states. With `--deterministic` (the CPU's default; `cvl.device`)
the kernels are deterministic too, so a resumed run ends bit-identical to an uninterrupted one.

Per step, nothing leaves the device: loss terms and metrics are summed there and reduced
across ranks (one all_reduce, one host sync) only when a log line is written, every
`log_every` steps, at each mid-task checkpoint and at the task's end; a line holds the means
over the steps since the previous one. One loader (with its workers) serves a whole task.

Files (see `cvl/runs.py`): run.json, init/ (initial weights), tasks/NN-name/ (one per
finished task: model, method state, log), last/ (mid-task checkpoint, atomic), logs/.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cvl import __version__
from cvl.data.augment import device_images, train_transform
from cvl.data.reader import (
    PairDataset,
    default_workers,
    eval_loader,
    global_batches,
    make_loader,
    sample_seed,
)
from cvl.data.transforms import image_transform
from cvl.device import nondeterministic_ops_stop
from cvl.dist import GradReducer, broadcast_module, world_size
from cvl.errors import CvlError
from cvl.io import atomic_dir, read_json, recover_dir, write_json
from cvl.methods.base import Method, TaskContext, frozen_copy
from cvl.methods.registry import get_method
from cvl.runs import MODEL_FILE, RUN_JSON, RUN_SCHEMA, task_dir
from cvl.streams.manifest import Manifest, load_manifest
from cvl.train.budget import measure_step, parse_budget, plan_task
from cvl.train.checkpoint import load_state, load_torch, save_state, save_torch
from cvl.train.config import TrainConfig, config_diff
from cvl.train.cost import CostTracker, summarize_run
from cvl.train.selection import BestKeeper, selection_set, val_score

LAST = "last"
METHOD_STATE = "method_state"
TUNE_STATE = "tune.safetensors"  # in last/: the adapters and base weights (--tune lora/dora)
BEST_MODEL = "best_model.safetensors"  # in last/: the best-on-validation weights so far
# A task stops when more than this share of its optimizer steps (and more than one) were
# skipped for a non-finite loss, whatever --skip-nonfinite allows: it is no longer training.
MAX_SKIPPED_SHARE = 0.1


def cosine_schedule(total: int, warmup: float, base_lr: float, min_lr: float):
    """LR multiplier: linear warm-up, then cosine from base_lr to min_lr over `total` steps."""
    w = int(round(warmup * total)) if warmup < 1 else int(warmup)
    floor = min_lr / base_lr if base_lr > 0 else 0.0

    def f(step: int) -> float:
        if w > 0 and step < w:
            return (step + 1) / w
        p = (step - w) / max(1, total - w)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))

    return f


def optimizer_with_schedule(params: list, cfg: Any, steps: int):
    """The training optimizer + warm-up/cosine lr: AdamW, or (`optimizer: lamb`) LAMB (You et
    al. 2020; timm's, with no clipping of its own: `grad_clip` does that), no weight decay on
    gains, biases and scales (LAMB's trust ratio only where weights decay, as NVLAMB)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (cfg.beta1, cfg.beta2)
    if getattr(cfg, "optimizer", "adamw") == "lamb":
        from timm.optim import Lamb

        opt = Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, max_grad_norm=None)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, cosine_schedule(steps, cfg.warmup, cfg.lr, cfg.min_lr)
    )
    return opt, sched


def _manifest_sha(m: Manifest) -> str | None:
    """SHA-256 of the stream's stream.json: a stream rebuilt in place changes it (`created`)."""
    from cvl.streams.manifest import MANIFEST, file_sha256

    f = m.root / MANIFEST if m.root is not None else None
    return file_sha256(f) if f is not None and f.is_file() else None


def seed_torch(seed: int, device: torch.device) -> None:
    """torch.manual_seed (the CPU generator and every CUDA generator), without its lazy
    accelerator seeding when training on the CPU.

    On a CPU-only run `torch.manual_seed` queues a deferred seeding call (with a captured
    traceback) for each accelerator type every time: milliseconds per step and a list that
    grows for the whole run. The CPU generator's draws are the same either way.
    """
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class _LogWindow:
    """Loss terms, metrics and counts of the optimizer steps since the last log line.

    Sums stay on the device (no host sync per step); `reduce()` averages them over the
    window's steps and the ranks with one all_reduce, when a line is written.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, float] = {}  # metrics: steps (micro-batches / grad_accum) set
        self.steps, self.samples, self.replaced, self.t0 = 0, 0, 0, time.perf_counter()
        self.skipped = 0  # optimizer steps skipped for a non-finite loss
        self.skipped_terms: dict[str, float] = {}  # the last skipped step's terms (NaN/Inf)

    def _add(self, key: str, v: Any, weight: float) -> None:
        v = torch.as_tensor(v).detach().to(self.device, torch.float32) * weight
        self.sums[key] = self.sums[key] + v if key in self.sums else v

    def add_micro(
        self, terms: dict[str, Any], metrics: dict[str, Any], grad_accum: int, batch: dict
    ) -> None:
        """One micro-batch: terms and metrics enter with weight 1/grad_accum."""
        for k, v in terms.items():
            self._add("t:" + k, v, 1 / grad_accum)
        for k, v in metrics.items():
            self._add("m:" + k, v, 1 / grad_accum)
            self.counts["m:" + k] = self.counts.get("m:" + k, 0.0) + 1 / grad_accum
        self.samples += batch["image"].shape[0]
        self.replaced += batch["n_replaced"]

    def add_step(self, grad_norm: torch.Tensor | None) -> None:
        self.steps += 1
        if grad_norm is not None:
            self._add("grad_norm", grad_norm, 1.0)

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def reduce(self) -> dict[str, float]:
        """Step means of the window (metrics: over the steps that set them), rank means;
        `samples` and `replaced` are totals over ranks. Resets the window."""
        keys = sorted(self.sums)
        vec = torch.stack(
            [self.sums[k] for k in keys]
            + [torch.tensor(float(x), device=self.device) for x in (self.samples, self.replaced)]
        )
        w = world_size()
        if w > 1:
            torch.distributed.all_reduce(vec)
        vals = vec.tolist()
        out = {}
        for k, v in zip(keys, vals):
            n = self.counts[k] if k.startswith("m:") else self.steps
            out[k] = v / w / max(n, 1e-9)
        out["samples"], out["replaced"] = vals[-2], vals[-1]
        self._reset()
        return out


class Trainer:
    """Runs (or resumes) `cfg` into `cfg.out`; call `run()`."""

    def __init__(self, cfg: TrainConfig, force: bool = False, progress: bool = True) -> None:
        from cvl.device import accelerator, apply_determinism, launch_device

        self.cfg = cfg
        self.out = Path(cfg.out)
        self.progress = progress
        log_with = self._trackers(cfg.log_with)
        # before the model reaches a GPU: the cuBLAS workspace is fixed at its first call
        self.deterministic = apply_determinism(cfg.deterministic, launch_device(cfg.device))
        try:
            self.acc = accelerator(
                cfg.device,
                mixed_precision=cfg.precision,
                log_with=log_with,
                project_dir=str(self.out / "logs"),
            )
        except (ValueError, RuntimeError) as e:
            raise CvlError(f"accelerate: {e}") from None
        kind = str(getattr(self.acc.distributed_type, "value", self.acc.distributed_type))
        if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
            raise CvlError(
                f"accelerate config selects {kind}: not supported (cvl keeps a full replica per "
                "process and averages gradients itself, so methods can run frozen copies and "
                "sub-encoders); use a plain multi-GPU config with --precision bf16, "
                "--grad-checkpointing and --grad-accum (README: Scaling up)"
            )
        self.manifest: Manifest = load_manifest(cfg.stream)
        self.cost = CostTracker(self.acc.device)  # FLOPs, memory, time (cvl.train.cost)
        self.budget = parse_budget(cfg.budget)
        self.method_cls = get_method(cfg.method)
        self.method: Method = self.method_cls(cfg.method_args)
        if self.method.needs_buffer and not cfg.buffer:
            hint = getattr(self.method, "buffer_hint", "reservoir")
            raise CvlError(
                f"method '{cfg.method}' needs a replay buffer: add --buffer {hint} --buffer-size N"
            )
        self._lock_run_dir()
        try:
            self._prepare_run_dir(force)
        except BaseException:
            self._release_lock()
            raise
        if cfg.workers >= 0:
            self.workers = cfg.workers
        else:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.acc.num_processes))
            self.workers = default_workers(local)
        # the training forward; methods' extra passes (old models, sub-encoders) stay eager
        self._forward = torch.compile(self.model) if cfg.compile else self.model
        self._entries: dict[str, list] = {}
        self._prev_cache: tuple[int, Any] | None = None
        self._reducer = GradReducer()  # gradients averaged over ranks during the backward

    # -- setup -------------------------------------------------------------------------------
    @staticmethod
    def _trackers(log_with: str) -> list[str] | None:
        if log_with == "none":
            return None
        if log_with == "auto":
            try:
                import tensorboard  # noqa: F401

                return ["tensorboard"]
            except ImportError:
                return None
        return [log_with]

    def _run_json(self) -> dict[str, Any]:
        import accelerate
        import open_clip

        m = self.manifest
        return {
            "schema": RUN_SCHEMA,
            "config": self.cfg.to_json(),
            "model": self.model.config(),
            "stream": {
                "path": str(Path(self.cfg.stream).absolute()),
                "name": m.name,
                "task_order": list(m.task_order),
                "fingerprint": m.fingerprint,
                "manifest_sha256": _manifest_sha(m),
            },
            "versions": {
                "cvl": __version__,
                "torch": torch.__version__,
                "open_clip": open_clip.__version__,
                "accelerate": accelerate.__version__,
                "python": platform.python_version(),
            },
            "processes": self.acc.num_processes,
            "cost": summarize_run(self.out),
            "tuning": self.tuning.summary(),
            "runtime": self._runtime(),
            "earlier_runtimes": getattr(self, "_earlier_runtimes", []),
        }

    def _runtime(self) -> dict[str, Any]:
        """Where and how reproducibly this session trains (main process's device)."""
        return {
            "device": str(self.acc.device),
            "deterministic": self.deterministic,
            "deterministic_source": "default" if self.cfg.deterministic is None else "option",
        }

    def _note_runtime_change(self, old: dict[str, Any]) -> None:
        """Keep the earlier sessions' runtimes that differ; say when determinism changes."""
        self._earlier_runtimes = list(old.get("earlier_runtimes") or [])
        before, now = old.get("runtime"), self._runtime()
        if not before or before == now:
            return
        self._earlier_runtimes.append(before)
        if before.get("deterministic") != now["deterministic"] and self.acc.is_main_process:
            flag = "--deterministic" if now["deterministic"] else "--no-deterministic"
            self.acc.print(
                f"note: {self.out} continues with {flag} (it trained with the other mode so "
                "far); run.json records both: an exact rerun needs the same mode throughout"
            )

    def _prepare_run_dir(self, force: bool) -> None:
        from cvl.models import build_model

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        start = cfg.pretrained
        if cfg.init_run:
            from cvl.runs import init_weights_file

            start = str(init_weights_file(cfg.init_run))
        self.model = build_model(cfg.model, cfg.model_config, pretrained=start)
        if cfg.grad_checkpointing:
            self.model.set_grad_checkpointing(True)
        self._sync_batchnorm()
        self.model.to(self.acc.device)
        broadcast_module(self.model)
        from cvl.models.tune import Tuning

        self.tuning = Tuning(cfg.tune, cfg.tune_args)  # which parameters train (cvl.models.tune)
        self.tuning.apply(self.model, self._tune_seed(0))
        rj = self.out / RUN_JSON
        history: list[dict[str, Any]] = []
        if rj.is_file():
            old = read_json(rj)
            diff = config_diff(old.get("config", {}), cfg.to_json())
            if old.get("stream", {}).get("fingerprint") != self.manifest.fingerprint:
                diff.append("stream: content differs (name, seed, task order or counts)")
            elif old.get("stream", {}).get("manifest_sha256", _manifest_sha(self.manifest)) != (
                _manifest_sha(self.manifest)
            ):
                diff.append("stream: stream.json was rewritten since the run started (rebuilt?)")
            if diff and not force:
                raise CvlError(
                    f"{self.out} holds a run with another config ({'; '.join(diff)}); "
                    "use another --out, or --force to continue with the new config"
                )
            history = self._forced_history(old, diff)
            self._note_runtime_change(old)
            self.resumed = True
        else:
            if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
                raise CvlError(
                    f"{self.out} exists and is not a cvl run folder; choose another --out"
                )
            self.resumed = False
        self.acc.wait_for_everyone()  # every rank has checked the folder before rank 0 writes
        if self.acc.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            write_json(rj, {**self._run_json(), **({"changes": history} if history else {})})
            if not (self.out / "init" / MODEL_FILE).is_file():
                from cvl.models import save_weights

                with atomic_dir(self.out / "init", overwrite=True) as tmp:
                    save_weights(self.model, tmp / MODEL_FILE)
        self.acc.wait_for_everyone()

    def _tune_seed(self, ti: int) -> int:
        """The seed of task `ti`'s fresh adapter (`--tune lora/dora`)."""
        return sample_seed(int(self.cfg.seed), ti, 29)

    def _lock_run_dir(self) -> None:
        """Hold RUN's lock for the whole run (rank 0; every rank learns the outcome), then
        remove what killed writers left: temp and old copies of last/, init/, task folders."""
        from cvl.io import recover_children
        from cvl.lock import lock_on_main

        self._lock = lock_on_main(self.out, self.acc)
        if self.acc.is_main_process and (self.out / RUN_JSON).is_file():
            recover_children(self.out)
            recover_children(self.out / "tasks")
        self.acc.wait_for_everyone()

    def _release_lock(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()

    def _resume_at(self) -> tuple[int, dict[str, Any] | None]:
        """The first task still to train and, if last/ holds that task's mid-task checkpoint,
        its position (last/position.json)."""
        order = list(self.manifest.task_order)
        single = getattr(self.method, "single_task", False)
        indices = [len(order) - 1] if single else list(range(len(order)))
        done = [i for i in indices if (task_dir(self.out, i, order[i]) / MODEL_FILE).is_file()]
        start = next((i for i in indices if i not in done), len(order))
        lp = self.out / LAST / "position.json"
        pos = read_json(lp) if lp.is_file() else None
        return start, pos if pos is not None and pos.get("task_index") == start else None

    def _forced_history(self, old: dict[str, Any], diff: list[str]) -> list[dict[str, Any]]:
        """run.json's record of the config changes made with --force: earlier ones kept, this
        one added with the task and step from which it applies. A change that a mid-task
        checkpoint cannot carry on with (anything but the optimizer and schedule settings) is
        refused while a task is half done."""
        import datetime

        from cvl.train.config import MIDTASK_KEYS, config_changes

        history = list(old.get("changes") or [])
        self._forced: set[str] = set()
        if not diff:
            return history
        fields = config_changes(old.get("config", {}), self.cfg.to_json())
        stream = [d for d in diff if d.startswith("stream:")]
        start, pos = self._resume_at()
        order = list(self.manifest.task_order)
        if pos is not None:
            bad = sorted(set(fields) - MIDTASK_KEYS)
            bad += ["the stream's content"] if any("content differs" in d for d in stream) else []
            if bad:
                raise CvlError(
                    f"{self.out}: --force cannot change {', '.join(bad)} in the middle of task "
                    f"{order[start]} (last/ holds step {pos['step']}): rerun with the old "
                    f"value(s) to finish the task, or delete {self.out / LAST}/ to restart the "
                    "task from its beginning with the new ones"
                )
        self._forced = set(fields)
        history.append(
            {
                "task_index": start,
                "task": order[start] if start < len(order) else None,
                "step": pos["step"] if pos is not None else 0,
                "fields": {k: [a, b] for k, (a, b) in fields.items()},
                **({"stream": stream} if stream else {}),
                "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            }
        )
        if self.acc.is_main_process:
            where = f"task {start}" + (f", step {pos['step']}" if pos is not None else "")
            self.acc.print(
                f"--force: {', '.join(sorted(fields)) or 'stream'} changed from {where} on"
            )
        return history

    def _sync_batchnorm(self) -> None:
        """BatchNorm statistics over the global batch when several GPUs train (SyncBatchNorm).

        torch's SyncBatchNorm has no CPU kernel, so multi-process CPU runs keep per-process
        statistics (as plain DDP does) and say so; models without BatchNorm are unaffected.
        """
        has_bn = any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in self.model.modules()
        )
        if not has_bn or self.acc.num_processes == 1:
            return
        if self.acc.device.type == "cuda":
            self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model)
        elif self.acc.is_main_process:
            self.acc.print(
                "note: the model has BatchNorm; on CPU its statistics are per process "
                "(no SyncBatchNorm kernel), so N processes x batch B differ slightly from 1 x N*B"
            )

    # -- services for methods and buffers ------------------------------------------------------
    def entries_of(self, task: str) -> list:
        """Training entries of a task (indexed once per run)."""
        if task not in self._entries:
            ds = PairDataset.from_shards(self.manifest.train_shards(task), name=f"task {task}")
            self._entries[task] = ds.entries
            self.skipped = getattr(self, "skipped", {})
            self.skipped[task] = dict(ds.skipped)
        return self._entries[task]

    def previous_model(self, ctx: TaskContext) -> Any:
        """Frozen copy of the weights saved after task `ctx.task_index - 1`."""
        from cvl.models import load_weights

        i = ctx.task_index - 1
        if self._prev_cache is None or self._prev_cache[0] != i:
            m = frozen_copy(self.model)
            load_weights(m, task_dir(self.out, i, self.order[i]) / MODEL_FILE)
            self._prev_cache = (i, m.to(self.acc.device))
        return self._prev_cache[1]

    @torch.no_grad()
    def pair_features(self, entries: list, batch_size: int = 256) -> torch.Tensor:
        """One feature per pair for buffer selection: fusion CLS, else normalise(v + w)."""
        model = self.model
        ds = PairDataset(entries, image_transform(model.image_size, train=False), model.tokenizer)
        was = model.training
        model.eval()
        feats = []
        rank, world = self.acc.process_index, self.acc.num_processes
        for b in eval_loader(ds, batch_size, rank=rank, world=world):
            img, txt = b["image"].to(self.acc.device), b["text"].to(self.acc.device)
            out = model(img, txt)
            if getattr(model, "has_fusion", False):
                f = torch.nn.functional.normalize(
                    model.fusion_cls(out["image_embeds"], txt), dim=-1
                )
            else:
                f = torch.nn.functional.normalize(
                    out["image_features"] + out["text_features"], dim=-1
                )
            feats.append(f.float())
        model.train(was)
        local = torch.cat(feats) if feats else torch.zeros(0, model.embed_dim)
        if world > 1:
            from cvl.evaluation.embed import _gather_rows

            return _gather_rows(local, self.acc, len(ds))
        return local.cpu()

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """Train every task not finished yet, resuming a mid-task checkpoint; releases RUN's
        lock at the end (the kernel does if the process dies)."""
        try:
            self._run()
        finally:
            self.cost.abort()  # an exception inside the counted step: leave its dispatch mode
            self._release_lock()

    def _run(self) -> None:
        cfg, acc = self.cfg, self.acc
        self.order = list(self.manifest.task_order)
        if self.acc.is_main_process and self._trackers(cfg.log_with):
            acc.init_trackers("cvl", config={k: str(v) for k, v in cfg.to_json().items()})
        buffer = None
        if cfg.buffer:
            from cvl.methods.buffers import build_buffer

            buffer = build_buffer(cfg.buffer, cfg.buffer_size, cfg.seed, self.manifest.root)
        ctx = TaskContext(
            model=self.model,
            accelerator=acc,
            config=cfg,
            manifest=self.manifest,
            run_dir=self.out,
            buffer=buffer,
            services=self,
        )
        self.method.setup(ctx)
        single = getattr(self.method, "single_task", False)
        indices = [len(self.order) - 1] if single else list(range(len(self.order)))
        self.indices = indices
        start, pos = self._resume_point(indices, ctx)
        with nondeterministic_ops_stop(acc.device):  # deterministic mode: name the op, one line
            for ti in indices:
                if ti < start:
                    continue
                self._train_task(ti, ctx, pos if ti == start else None)
        acc.wait_for_everyone()
        if acc.is_main_process:
            acc.end_training()

    def _resume_point(self, indices: list[int], ctx: TaskContext) -> tuple[int, dict | None]:
        """First task to train and, if a mid-task checkpoint matches it, its position."""
        from cvl.models import load_weights

        done = [i for i in indices if (task_dir(self.out, i, self.order[i]) / MODEL_FILE).is_file()]
        if done:
            last_done = max(done)
            d = task_dir(self.out, last_done, self.order[last_done])
            load_weights(self.model, d / MODEL_FILE)
            st = load_state(d, METHOD_STATE)
            self._restore_method_state(st, ctx)
        if self.acc.is_main_process:
            recover_dir(self.out / LAST)  # a kill inside the last/ swap: the previous one
        self.acc.wait_for_everyone()
        start, pos = self._resume_at()  # a stale last/ (of a task since finished) is ignored
        if start >= len(self.order) and self.acc.is_main_process:
            self.acc.print(
                f"{self.out}: all {len(self.order)} tasks already trained; nothing to do"
            )
        elif (done or pos) and self.acc.is_main_process:
            where = f"task {start} ({self.order[start]})" + (f", step {pos['step']}" if pos else "")
            self.acc.print(f"resuming {self.out} at {where}")
        return start, pos

    def _restore_method_state(self, st: dict[str, Any], ctx: TaskContext) -> None:
        if not st:
            return
        self.method.load_state_dict(st.get("method", {}))
        if ctx.buffer is not None and st.get("buffer"):
            ctx.buffer.load_state_dict(st["buffer"])

    def _method_state(self, ctx: TaskContext) -> dict[str, Any]:
        st: dict[str, Any] = {"method": self.method.state_dict()}
        if ctx.buffer is not None:
            st["buffer"] = ctx.buffer.state_dict()
        return st

    def _micro(
        self, batch: dict, ctx: TaskContext, forward: Any, transform: Any = None
    ) -> tuple[dict, torch.Tensor]:
        """One micro-batch's forward and loss terms (images finished on the device by the
        split `transform`, or moved there as they are); (terms, sum)."""
        acc = self.acc
        batch["image"] = device_images(batch, transform, acc.device)
        batch["text"] = batch["text"].to(acc.device, non_blocking=True)
        with acc.autocast():
            out = forward(batch["image"], batch["text"])
            terms = self.method.loss(batch, out, ctx)
        if not terms:
            raise CvlError(f"method '{self.cfg.method}' returned no loss terms")
        return terms, sum(terms.values())

    def _update(self, ctx: TaskContext, opt: Any, params: list, clip: Any, reduce: Any) -> Any:
        """Gradients averaged over ranks (`reduce`: the overlapped GradReducer's `finish`, or
        `average_gradients` for a probe, which leaves the reducer untouched), the method's
        `after_backward`, clipping (`clip`: the accelerator's, or torch's for a probe) and the
        optimizer step; the grad norm."""
        reduce(params)
        self.method.after_backward(ctx)
        gnorm = clip(params, self.cfg.grad_clip) if self.cfg.grad_clip > 0 else None
        opt.step()
        return gnorm

    def _params(self) -> list[torch.nn.Parameter]:
        ps = [p for p in self.model.parameters() if p.requires_grad]
        return ps + [p for p in self.method.extra_parameters() if p.requires_grad]

    def _optimizer(self, steps: int):
        opt, sched = optimizer_with_schedule(self._params(), self.cfg, steps)
        self._opt = self.acc.prepare_optimizer(opt, device_placement=False)
        return self._opt, sched

    def _load_last(self, opt: Any, sched: Any, ctx: TaskContext, total: int) -> None:
        """Restore the mid-task checkpoint (weights, optimizer, schedule, method state), then
        the optimizer settings a --force resume changed; an unreadable file is one line."""
        from cvl.models import load_weights

        last = self.out / LAST
        try:
            load_weights(self.model, last / MODEL_FILE)
            if (last / TUNE_STATE).is_file():  # --tune lora/dora: the adapters and base weights
                from safetensors.torch import load_file

                self.tuning.load_state(self.model, load_file(str(last / TUNE_STATE)))
            opt.load_state_dict(load_torch(last / "optimizer.pt"))
            sched.load_state_dict(load_torch(last / "scheduler.pt"))
            self._restore_method_state(load_state(last, METHOD_STATE), ctx)
        except Exception as e:  # noqa: BLE001 (torch, safetensors and JSON raise their own)
            why = " ".join(str(e).split())[:160] or type(e).__name__
            raise CvlError(
                f"{last}: the mid-task checkpoint of task {ctx.task_name} cannot be read "
                f"({why}); delete {last}/ to restart the task from its beginning "
                "(finished tasks are kept)"
            ) from None
        self._apply_forced_settings(opt, sched, total)

    def _apply_forced_settings(self, opt: Any, sched: Any, total: int) -> None:
        """After a --force resume that changed lr, min_lr, warmup, weight decay, betas or eps:
        this config's settings and schedule from the resumed step on (the loaded state holds
        the old ones). The optimizer's moments and the step count are kept."""
        from cvl.train.config import MIDTASK_KEYS

        if not (getattr(self, "_forced", set()) & MIDTASK_KEYS):
            return
        fresh, fresh_sched = optimizer_with_schedule(self._params(), self.cfg, total)
        for g, f in zip(opt.param_groups, fresh.param_groups):
            g.update({k: v for k, v in f.items() if k != "params"})
        sched.base_lrs = list(fresh_sched.base_lrs)
        sched.lr_lambdas = fresh_sched.lr_lambdas
        for g, base, lam in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            g["lr"] = base * lam(sched.last_epoch)

    def _train_task(self, ti: int, ctx: TaskContext, pos: dict | None) -> None:
        cfg, acc = self.cfg, self.acc
        name = self.order[ti]
        ctx.task_index, ctx.task_name, ctx.resuming = ti, name, pos is not None
        ctx.task_entries = self.entries_of(name)
        ctx.epoch = ctx.step = 0
        self._log_path = self.out / "logs" / f"{ti:02d}-{name}.jsonl"
        self._keeper: BestKeeper | None = None
        self.cost.begin_task(pos.get("cost") if pos else None)
        self._budget_rec: dict | None = None
        if not self.method.trains:
            self._finish_task(ti, ctx, [])
            return
        self.tuning.begin_task(self.model, self._tune_seed(ti))
        with self.cost.extra("before_task", skip=ctx.resuming):  # counted before a resume
            self.method.before_task(ctx)
        sel = selection_set(self.manifest, name, cfg.select, self.method)
        self._keeper = BestKeeper() if sel else None
        wants = cfg.select == "auto" and getattr(self.method, "selects_best_val", False)
        if wants and sel is None and acc.is_main_process:
            acc.print(f"note: no 'val' pairs for task {name}: {cfg.method} keeps the last weights")
        entries = self.method.task_entries(ctx)
        ds = PairDataset(
            entries,
            transform=train_transform(self.model.image_size, cfg.augment, acc.device),
            tokenize=self.model.tokenizer,
            skipped=Counter(self.skipped.get(name, {})),
            name=f"task {name}",
        )
        gb = cfg.batch_size * acc.num_processes
        batches_per_epoch = len(global_batches(len(ds), gb, 0, 0))
        steps_per_epoch = max(1, batches_per_epoch // cfg.grad_accum)
        total = steps_per_epoch * cfg.epochs
        if cfg.max_steps_per_task:
            total = min(total, cfg.max_steps_per_task)
        ctx.steps_in_task = total
        if self.budget is not None:  # the steps the task's budget buys (cvl.train.budget)
            total, self._budget_rec = plan_task(self, ctx, ds, gb, total, pos)
            ctx.steps_in_task = total
        elif cfg.compile and self.cost.enabled and not self.cost.has_step:
            measure_step(self, ctx, ds, gb)  # compiled graphs hide their ops: count eagerly
        count_step = self.cost.enabled and not self.cost.has_step
        opt, sched = self._optimizer(total)
        epoch0, batch0 = 0, 0
        if pos is not None:
            last = self.out / LAST
            self._load_last(opt, sched, ctx, total)
            epoch0, batch0, ctx.step = pos["epoch"], pos["batch"], pos["step"]
            self._truncate_log(ctx.step)
            if self._keeper is not None:
                self._restore_keeper(last, pos)
                if batch0 == 0 and self._keeper.validated < epoch0 - 1:
                    self._validate(sel, ctx, epoch0 - 1)  # saved right after that epoch's end
        elif acc.is_main_process and self._log_path.exists():
            self._log_path.unlink()
        ctx.global_step = sum(self._steps_done_before(ti)) + ctx.step
        self.model.train()
        bar = tqdm(
            total=total,
            initial=ctx.step,
            desc=f"task {ti + 1}/{len(self.order)} {name}",
            disable=not (self.progress and acc.is_main_process),
            unit="step",
            dynamic_ncols=True,
        )
        seed_task = sample_seed(cfg.seed, ti)
        n_batches = len(global_batches(len(ds), gb, seed_task, 0))
        usable = (n_batches // cfg.grad_accum) * cfg.grad_accum or n_batches

        def plan():  # the global batches still to train, over all epochs (lazy), no more
            left = max(0, total - ctx.step) * cfg.grad_accum
            for e in range(epoch0, cfg.epochs):
                bs = global_batches(len(ds), gb, seed_task, e)[:usable]
                take = bs[(batch0 if e == epoch0 else 0) :][:left]
                left -= len(take)
                yield from take

        # one loader (one set of workers) for the whole task: they prefetch across epoch ends
        batches = iter(
            make_loader(
                ds,
                plan(),
                acc.process_index,
                acc.num_processes,
                self.workers,
                pin_memory=acc.device.type == "cuda",
            )
        )
        window = _LogWindow(acc.device)
        done = ctx.step >= total
        for epoch in range(epoch0, cfg.epochs):
            if done:
                break
            ctx.epoch = epoch
            start = batch0 if epoch == epoch0 else 0
            micro, skip_step = 0, False
            for bi in range(start, usable):
                batch = next(batches)
                if micro == 0:
                    if count_step:
                        self.cost.start_step(f"step {ctx.step + 1} of the task")
                    seed_torch(
                        sample_seed(cfg.seed, ti, epoch, ctx.step, acc.process_index), acc.device
                    )
                    ctx.generator = torch.Generator().manual_seed(
                        sample_seed(cfg.seed, ti, epoch, ctx.step)
                    )
                    self.method.before_step(ctx)
                terms, loss = self._micro(batch, ctx, self._forward, ds.transform)
                if self._nonfinite(loss, terms, batch, ctx):
                    skip_step = True  # no backward; the whole optimizer step is skipped
                else:
                    last = micro + 1 == cfg.grad_accum and not skip_step
                    self._reducer.prepare(self._params(), last)
                    acc.backward(loss / cfg.grad_accum)
                    window.add_micro(terms, ctx.metrics, cfg.grad_accum, batch)
                ctx.metrics = {}
                micro += 1
                if micro < cfg.grad_accum:
                    continue
                micro = 0
                params = self._params()
                gnorm = None
                lr = opt.param_groups[0]["lr"]
                if not skip_step:
                    gnorm = self._update(
                        ctx, opt, params, acc.clip_grad_norm_, self._reducer.finish
                    )
                sched.step()
                opt.zero_grad(set_to_none=True)
                ctx.step += 1
                ctx.global_step += 1
                if skip_step:
                    skip_step = False
                    window.skipped += 1
                    window.skipped_terms = {k: float(v.detach()) for k, v in terms.items()}
                else:
                    self.method.after_step(ctx)
                    window.add_step(gnorm)
                if count_step:
                    self.cost.stop_step()
                    count_step = False
                ckpt = bool(cfg.checkpoint_every) and ctx.step % cfg.checkpoint_every == 0
                if ctx.step % cfg.log_every == 0 or ctx.step >= total or ckpt:
                    self._flush_log(window, ctx, epoch, lr, bar)
                if ctx.step >= total:
                    done = True
                    break
                if ckpt:
                    nxt = (epoch, bi + 1) if bi + 1 < usable else (epoch + 1, 0)
                    self._save_last(ctx, opt, sched, {"epoch": nxt[0], "batch": nxt[1]})
            if self._keeper is not None:
                self._validate(sel, ctx, epoch)
        del batches  # stops the loader's workers
        bar.close()
        if self._keeper is not None and self._keeper.weights is not None:
            self.model.load_state_dict(self._keeper.weights)  # the task ends with the best
            k = self._keeper
            self.acc.print(f"task {name}: keeping epoch {k.epoch + 1} (val Rm {k.score:.2f})")
        with self.cost.extra("after_task"):
            self.method.after_task(ctx)
        self.tuning.end_task(self.model)  # LoRA/DoRA: merged, the checkpoint is plain weights
        if ctx.buffer is not None:
            with self.cost.extra("buffer_update"):
                ctx.buffer.update(name, ctx.task_entries, ctx)
        self._finish_task(ti, ctx, [])

    def _nonfinite(
        self, loss: torch.Tensor, terms: dict[str, torch.Tensor], batch: dict, ctx: TaskContext
    ) -> bool:
        """True when the loss is NaN/Inf on any rank and `--skip-nonfinite` allows a skip.

        The one host sync of a step (a finiteness flag; with several processes one all-reduce
        of it, so every rank takes the same decision and none waits in a collective the others
        skip): stopping at the exact step, with the batch's sample ids, needs it. Past the
        allowance the run stops with the term names, the step and the sample ids; last/ still
        holds the previous good checkpoint. A task also stops once more than
        `MAX_SKIPPED_SHARE` of its steps (and more than one) were skipped, whatever the
        allowance: a task that skips that many is no longer being trained.
        """
        flag = torch.isfinite(loss.detach()).float()
        if world_size() > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        if bool(flag):
            return False
        bad = [k for k, v in terms.items() if not bool(torch.isfinite(v.detach()).all())]
        self.nonfinite_skipped = getattr(self, "nonfinite_skipped", 0) + 1
        vals = ", ".join(f"{k}={float(v.detach()):.4g}" for k, v in terms.items() if k in bad)
        where = f"task {ctx.task_name} (index {ctx.task_index}), step {ctx.step + 1}"
        ids = [str(i) for i in batch.get("id", [])]
        if self.nonfinite_skipped > self.cfg.skip_nonfinite:
            raise CvlError(
                f"non-finite loss at {where}: {vals or 'on another rank'}; "
                f"sample ids (rank {self.acc.process_index}): {', '.join(ids[:32])}"
                + (" ..." if len(ids) > 32 else "")
                + f"; {self._lr_hint()}; {self._resume_hint(ctx)}: fix the data or the "
                "settings, or add --skip-nonfinite N"
            )
        n_task, limit = self._count_task_skip(ctx)
        if n_task > limit:
            raise CvlError(
                f"non-finite loss at {where}: {n_task} of the task's {ctx.steps_in_task} steps "
                f"skipped, more than {MAX_SKIPPED_SHARE:.0%} (at most {limit}): the task is not "
                f"training; {self._lr_hint()}; {self._resume_hint(ctx)}"
            )
        self.acc.print(
            f"warning: non-finite loss at {where} ({vals or 'on another rank'}): step skipped "
            f"({self.nonfinite_skipped} of --skip-nonfinite {self.cfg.skip_nonfinite})"
        )
        return True

    def _count_task_skip(self, ctx: TaskContext) -> tuple[int, int]:
        """Count one more skipped step of this task: (skipped so far, most allowed).

        Steps skipped before a resume come from the task's log (truncated to the resumed
        step); every rank reads it after the step's all-reduce, so all decide alike."""
        c = getattr(self, "_skips", None)
        if c is None or c[0] != ctx.task_index:
            logged = 0
            if self._log_path.is_file():
                for ln in self._log_path.read_text().splitlines():
                    logged += json.loads(ln).get("nonfinite_skipped", 0) if ln else 0
            c = self._skips = [ctx.task_index, logged]
        c[1] += 1
        return c[1], max(1, int(MAX_SKIPPED_SHARE * ctx.steps_in_task))

    def _lr_hint(self) -> str:
        opt = getattr(self, "_opt", None)
        now = f"lr {opt.param_groups[0]['lr']:.3g} at this step, " if opt is not None else ""
        return f"{now}--lr {self.cfg.lr:g}: a lower --lr or a --grad-clip often helps"

    def _resume_hint(self, ctx: TaskContext) -> str:
        """What a rerun of the same command starts from (nothing is promised that is not there)."""
        from cvl.runs import finished_tasks

        lp = self.out / LAST / "position.json"
        if lp.is_file():
            p = read_json(lp)
            if p.get("task_index") == ctx.task_index:
                return f"the run can resume from last/ (task {ctx.task_index}, step {p['step']})"
        done = [c for c in finished_tasks(self.out) if c.index < ctx.task_index]
        if done:
            return f"the run can resume from the end of task {done[-1].path.name}"
        return "no checkpoint yet: a rerun starts from the initial weights"

    def _check_weights(self, ctx: TaskContext) -> None:
        """Stop before a checkpoint holds NaN/Inf weights (at each checkpoint and task end:
        one finiteness flag per tensor, one host sync). Replicas are equal on every rank, so
        every rank stops alike without a collective."""
        params = list(self.model.named_parameters())
        if not params:
            return
        ok = torch.stack([torch.isfinite(p.detach()).all() for _, p in params])
        if bool(ok.all()):
            return
        bad = [n for (n, _), good in zip(params, ok.tolist()) if not good]
        raise CvlError(
            f"non-finite weights at task {ctx.task_name} (index {ctx.task_index}), step "
            f"{ctx.step}: {len(bad)} tensor(s), e.g. {bad[0]}; not saved; {self._lr_hint()}; "
            f"{self._resume_hint(ctx)}"
        )

    def _flush_log(
        self, window: _LogWindow, ctx: TaskContext, epoch: int, lr: float, bar: tqdm
    ) -> None:
        """Reduce the window across ranks (one all_reduce per line) and log it.

        Steps skipped for a non-finite loss (`--skip-nonfinite`) are not in the means; the
        line counts them as `nonfinite_skipped` (a line of skipped steps only shows the last
        one's non-finite terms).
        """
        n, skipped, dt = window.steps, window.skipped, window.seconds()
        bad_terms = window.skipped_terms
        vals = window.reduce()
        terms = {k[2:]: v for k, v in vals.items() if k.startswith("t:")}
        if n == 0 and skipped:  # a line of skipped steps only: show the values that failed
            terms = bad_terms
        rec = {
            "task": ctx.task_name,
            "task_index": ctx.task_index,
            "epoch": epoch,
            "step": ctx.step,
            "global_step": ctx.global_step,
            "steps": n,
            "lr": lr,
            "loss": sum(terms.values()),
            **terms,
            "samples_per_s": vals["samples"] / max(dt, 1e-9),
            "replaced_samples": int(vals["replaced"]),
        }
        rec.update({f"m/{k[2:]}": v for k, v in vals.items() if k.startswith("m:")})
        if "grad_norm" in vals:
            rec["grad_norm"] = vals["grad_norm"]
        if skipped:
            rec["nonfinite_skipped"] = skipped
        self._log(rec, ctx)
        bar.update(n + skipped)
        bar.set_postfix(loss=f"{rec['loss']:.3f}")

    def _validate(self, set_name: str, ctx: TaskContext, epoch: int) -> None:
        """Score the model on the task's validation pairs; the keeper keeps the best weights."""
        with self.cost.extra("validation"):
            score = val_score(self.model, self.manifest, set_name, ctx.task_name, self.acc)
        self._keeper.offer(self.model, score, epoch, ctx.step)

    def _restore_keeper(self, last: Path, pos: dict) -> None:
        from safetensors.torch import load_file

        f = last / BEST_MODEL
        self._keeper.load_info(pos.get("best") or {}, load_file(str(f)) if f.is_file() else None)

    def _steps_done_before(self, ti: int) -> list[int]:
        out = []
        for i in range(ti):
            p = self.out / "logs" / f"{i:02d}-{self.order[i]}.jsonl"
            if p.is_file():
                lines = p.read_text().splitlines()
                out.append(json.loads(lines[-1])["step"] if lines else 0)
        return out

    # -- files -------------------------------------------------------------------------------
    def _log(self, rec: dict[str, Any], ctx: TaskContext) -> None:
        if not self.acc.is_main_process:
            return
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self._trackers(self.cfg.log_with):
            scalars = {f"{ctx.task_name}/{k}": v for k, v in rec.items() if isinstance(v, float)}
            self.acc.log(scalars, step=ctx.global_step)

    def _truncate_log(self, step: int) -> None:
        """Drop log lines written after the checkpoint we resume from (they will be redone)."""
        if not self.acc.is_main_process or not self._log_path.is_file():
            return
        keep = [
            ln
            for ln in self._log_path.read_text().splitlines()
            if ln and json.loads(ln)["step"] <= step
        ]
        self._log_path.write_text("".join(ln + "\n" for ln in keep))

    def _save_last(self, ctx: TaskContext, opt: Any, sched: Any, where: dict[str, int]) -> None:
        """Mid-task checkpoint: written to a temp folder, then renamed over last/."""
        from cvl.models import save_weights

        self._check_weights(ctx)
        state = self._method_state(ctx)  # collective-free; every rank computes it
        cost = self.cost.state()  # collective: counts summed over ranks
        if self.acc.is_main_process:
            with atomic_dir(self.out / LAST, overwrite=True) as tmp:
                save_weights(self.model, tmp / MODEL_FILE)
                if self.tuning.adapters:
                    from safetensors.torch import save_file

                    save_file(self.tuning.state(self.model), str(tmp / TUNE_STATE))
                save_torch(tmp / "optimizer.pt", opt.state_dict())
                save_torch(tmp / "scheduler.pt", sched.state_dict())
                save_state(tmp, METHOD_STATE, state)
                pos = {"task_index": ctx.task_index, "task": ctx.task_name, "step": ctx.step}
                pos["cost"] = cost
                if self._budget_rec is not None:
                    pos["budget"] = self._budget_rec
                keeper = getattr(self, "_keeper", None)
                if keeper is not None:
                    pos["best"] = keeper.info()
                    if keeper.weights is not None:
                        from safetensors.torch import save_file

                        save_file(keeper.weights, str(tmp / BEST_MODEL))
                write_json(tmp / "position.json", {**pos, **where})
        self.acc.wait_for_everyone()

    def _fault_counts(self) -> dict[str, int]:
        """Unreadable samples replaced and NaN/Inf steps skipped in this task (from its log)."""
        recs = []
        if self._log_path.is_file():
            recs = [json.loads(x) for x in self._log_path.read_text().splitlines() if x]
        return {
            "replaced_samples": sum(r.get("replaced_samples", 0) for r in recs),
            "nonfinite_skipped_steps": sum(r.get("nonfinite_skipped", 0) for r in recs),
        }

    def _finish_task(self, ti: int, ctx: TaskContext, _: list) -> None:
        from cvl.models import save_weights

        self._check_weights(ctx)
        state = self._method_state(ctx)
        gb = self.cfg.batch_size * self.acc.num_processes * self.cfg.grad_accum
        cost = self.cost.task_record(ctx.step, gb, self.acc.num_processes)  # collective
        budget = getattr(self, "_budget_rec", None)
        if self.acc.is_main_process:
            d = task_dir(self.out, ti, self.order[ti])
            with atomic_dir(d, overwrite=True) as tmp:
                save_weights(self.model, tmp / MODEL_FILE)
                save_state(tmp, METHOD_STATE, state)
                if self._log_path.is_file():
                    shutil.copy(self._log_path, tmp / "train_log.jsonl")
                write_json(
                    tmp / "task.json",
                    {
                        "task": ctx.task_name,
                        "index": ti,
                        "steps": ctx.step,
                        "train_items": len(ctx.task_entries),
                        "buffer_items": len(ctx.buffer) if ctx.buffer is not None else 0,
                        "trainable_params": self.tuning.trainable,
                        "skipped": getattr(self, "skipped", {}).get(ctx.task_name, {}),
                        **self._fault_counts(),
                        "selection": (
                            k.info() if (k := getattr(self, "_keeper", None)) else {"by": "last"}
                        ),
                        "cost": cost,
                        **({"budget": budget} if budget is not None else {}),
                    },
                )
            rj = read_json(self.out / RUN_JSON)
            write_json(self.out / RUN_JSON, {**rj, "cost": summarize_run(self.out)})
            shutil.rmtree(self.out / LAST, ignore_errors=True)
            self.acc.print(f"task {ti + 1}/{len(self.order)} {ctx.task_name}: saved {d}")
        self.acc.wait_for_everyone()
