"""The one training loop, shared by every method (HF Accelerate for processes and precision).

Data: each task's samples (+ the replay buffer's) are a map-style dataset; every epoch's
global batches are a function of (seed, task, epoch) only, and rank r takes slice r of each
global batch, so 2 processes × batch B compute exactly what 1 process × batch 2B does (the
contrastive matrices are built over the gathered global batch, gradients are averaged across
ranks). Each optimizer step re-seeds torch's RNGs (CPU and, on a GPU, every CUDA generator)
and `ctx.generator` from (seed, task, epoch, step, rank), so a resumed run replays the same
randomness without saving RNG states. With `--deterministic` (the CPU's default; `cvl.device`)
the kernels are deterministic too, so a resumed run ends bit-identical to an uninterrupted one.

Per step, nothing leaves the device: loss terms and metrics stay there as the step made them
and are reduced across ranks (one all_reduce, one host read) only when a log line is written,
every `log_every` steps, at each mid-task checkpoint and at the task's end; a line holds the
means over the steps since the previous one, and that read is also where a NaN/Inf loss is
found (`cvl.train.guards`; `--skip-nonfinite` reads once per step, before the update). One
loader (with its workers) serves a whole task.

The run folder's files and checks live in `cvl.train.rundir`, the non-finite guards in
`cvl.train.guards`, the optimizer and seeding in `cvl.train.optim`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from cvl.data.augment import device_images, train_transform
from cvl.data.index import Entries
from cvl.data.mixture import build_mixture, task_data
from cvl.data.order import block_note
from cvl.data.reader import (
    PairDataset,
    default_workers,
    make_loader,
    sample_seed,
)
from cvl.data.shardcache import configure_io, prefetching
from cvl.device import drop_optimizers, nondeterministic_ops_stop
from cvl.dist import GradReducer
from cvl.errors import CvlError
from cvl.methods.base import Method, TaskContext, check_base_loss
from cvl.methods.registry import get_method
from cvl.progress import progress_bar
from cvl.streams.manifest import Manifest, load_manifest
from cvl.train import fsdp
from cvl.train.accum import FeatureCache, accumulate, is_cached, rank_major
from cvl.train.accum import check as check_accumulation
from cvl.train.budget import budget_options, measure_step, parse_budget, plan_task
from cvl.train.config import TrainConfig
from cvl.train.cost import CostTracker
from cvl.train.guards import NonFiniteGuards
from cvl.train.logwindow import LogWindow, first_nonfinite, log_record, trackers
from cvl.train.optim import optimizer_with_schedule, seed_torch
from cvl.train.plan import (
    BN_MESSAGE,
    batchnorm_message,
    check_plan,
    check_run,
    needs_two_rows,
    plan_steps,
)
from cvl.train.rundir import LAST, RunFolder
from cvl.train.schedules import (
    check_planned_rates,
    check_task_rates,
    lr_multiplier,
    task_position,
)
from cvl.train.selection import BestKeeper, selection_set, val_score
from cvl.train.services import TrainerServices


class Trainer(RunFolder, NonFiniteGuards, TrainerServices):
    """Runs (or resumes) `cfg` into `cfg.out`; call `run()`."""

    def __init__(self, cfg: TrainConfig, force: bool = False, progress: bool = True) -> None:
        from cvl.device import accelerator, apply_determinism, launch_device

        self.cfg = cfg
        self.out = Path(cfg.out)
        self.progress = progress
        log_with = trackers(cfg.log_with)
        # before the model reaches a GPU: the cuBLAS workspace is fixed at its first call
        dev = launch_device(cfg.device)
        if cfg.precision == "fp16" and dev.type == "cpu":
            raise CvlError(
                "--precision fp16 needs a GPU: on the CPU Accelerate applies neither float16 "
                "autocast nor loss scaling, so the run would train in float32; use "
                "--precision bf16 (CPU autocast) or no"
            )
        self.deterministic = apply_determinism(cfg.deterministic, dev)
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
                f"accelerate config selects {kind}: not supported (cvl shards models itself, "
                "the frozen ones a method holds too); use a plain multi-GPU config and "
                "`cvl train --fsdp` (docs/scaling.md)"
            )
        configure_io(cfg.io_concurrency, cfg.shard_cache, cfg.shard_cache_gb)  # before any read
        fsdp.check_config(cfg)
        self.manifest: Manifest = load_manifest(cfg.stream)
        # set before anything reads them: run.json's stream plan indexes the tasks' entries
        self._entries: dict[str, Entries] = {}
        self._prev_cache: tuple[int, Any] | None = None
        self.mixture = build_mixture(cfg)  # --mixture: each batch's shares (cvl.data.mixture)
        unknown = sorted(set(cfg.task_lr) - set(self.manifest.tasks))
        if unknown:
            raise CvlError(
                f"--task-lr {unknown[0]}: stream '{self.manifest.name}' has no such task "
                f"(tasks: {', '.join(self.manifest.task_order)})"
            )
        self.cost = CostTracker(self.acc.device)  # FLOPs, memory, time (cvl.train.cost)
        self.budget = parse_budget(cfg.budget)
        self.budget_opts = budget_options(self.budget, cfg.budget_args)
        self.method_cls = get_method(cfg.method)
        self.method: Method = self.method_cls(cfg.method_args)
        cached = is_cached(cfg)
        check_accumulation(self.method, cfg)  # a method cached accumulation cannot serve
        if cfg.base_loss != "itc" and getattr(self.method, "itc_only", False):
            raise CvlError(
                f"method '{cfg.method}' trains with its own contrastive objective: "
                f"--base-loss {cfg.base_loss} is not available for it (use --base-loss itc)"
            )
        if self.method.needs_buffer and not cfg.buffer:
            hint = getattr(self.method, "buffer_hint", "reservoir")
            raise CvlError(
                f"method '{cfg.method}' needs a replay buffer: add --buffer {hint} --buffer-size N"
            )
        if cfg.fsdp:
            fsdp.check_method(self.method)
        tunes = getattr(self.method, "tunes", None)
        if tunes and cfg.tune not in tunes:
            raise CvlError(f"method '{cfg.method}' needs --tune {' or '.join(tunes)}")
        # settings that leave a task without a step: refused before anything is written
        self._plans = check_run(cfg, self.manifest, self.method, self.acc.num_processes)
        order = list(self.manifest.task_order)
        single = getattr(self.method, "single_task", False)
        trained = order[-1:] if single else order
        check_base_loss(cfg, self.manifest, trained)
        restarts = bool(getattr(self.method, "restarts", False))
        planned = [p.steps if (p := self._plans.get(t)) else None for t in trained]
        check_planned_rates(cfg, planned, trained, restarts)
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
        self._reducer = GradReducer()  # gradients averaged over ranks during the backward
        # --accum-mode cached: one loss over the step's micro-batches (cvl.train.accum)
        self._cache = FeatureCache(self.model, cfg.grad_accum, self.acc.device) if cached else None
        self._clip = torch.nn.utils.clip_grad_norm_
        if cfg.fsdp:  # weights, gradients, optimizer state sharded (cvl.train.fsdp)
            fsdp.shard_(self.model, self.acc.device, cfg.precision)
            self._reducer = fsdp.ShardedReducer(self.model, self._reducer)
            self._clip = fsdp.clip_grad_norm_

    # -- setup -------------------------------------------------------------------------------

    def _tune_seed(self, ti: int) -> int:
        """The seed of task `ti`'s fresh adapter (`--tune lora/dora`)."""
        return sample_seed(int(self.cfg.seed), ti, 29)

    def _sync_batchnorm(self) -> None:
        """BatchNorm statistics over the global batch or per process (`--sync-bn`,
        `cvl.train.batchnorm`); models without BatchNorm are unaffected."""
        from cvl.train.batchnorm import sync_batchnorm

        n = self.acc.num_processes
        self.model, note = sync_batchnorm(self.model, self.cfg.sync_bn, self.acc.device, n)
        if note and self.acc.is_main_process:
            self.acc.print(note)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        """Train every task not finished yet, resuming a mid-task checkpoint; releases RUN's
        lock at the end (the kernel does if the process dies)."""
        try:
            self._run()
        finally:
            self.cost.abort()  # an exception inside the counted step: leave its dispatch mode
            self._release_lock()
            fsdp.release()  # a one-process --fsdp run's group

    def _run(self) -> None:
        cfg, acc = self.cfg, self.acc
        self.order = list(self.manifest.task_order)
        buffer = None
        if cfg.buffer:
            from cvl.methods.buffers import build_buffer

            buffer = build_buffer(
                cfg.buffer, cfg.buffer_size, cfg.seed, self.manifest.root, self.entries_of
            )
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
        if not self.resumed:  # a new run: run.json and init/ once the setup has passed
            self._commit_run_json()
            acc.wait_for_everyone()
        single = getattr(self.method, "single_task", False)
        indices = [len(self.order) - 1] if single else list(range(len(self.order)))
        self.indices = indices
        start, pos = self._resume_point(indices, ctx)
        todo = any(ti >= start for ti in indices)  # a finished run writes nothing, not even logs
        if todo and self.acc.is_main_process and trackers(cfg.log_with):
            try:
                acc.init_trackers("cvl", config={k: str(v) for k, v in cfg.to_json().items()})
            except Exception as e:  # noqa: BLE001 (each tracker raises its own: wandb's login)
                why = " ".join(str(e).split())[:200] or type(e).__name__
                raise CvlError(
                    f"--log-with {cfg.log_with}: the tracker did not start ({why}); fix that "
                    "(for wandb: `wandb login`, or WANDB_MODE=offline) or use --log-with "
                    "tensorboard or none, and rerun the same command"
                ) from None
        with nondeterministic_ops_stop(acc.device):  # deterministic mode: name the op, one line
            for ti in indices:
                if ti < start:
                    continue
                self._train_task(ti, ctx, pos if ti == start else None)
        acc.wait_for_everyone()
        if acc.is_main_process:
            acc.end_training()

    def _micro(
        self, batch: dict, ctx: TaskContext, forward: Any, transform: Any = None
    ) -> tuple[dict, torch.Tensor]:
        """One micro-batch's forward and loss terms (images finished on the device by the
        split `transform`, or moved there as they are); (terms, sum)."""
        self._inputs(batch, transform)
        return self._terms(batch, self._outputs(batch, ctx, forward), ctx)

    def _inputs(self, batch: dict, transform: Any = None) -> None:
        """The batch's images and tokens on the device (images finished by the split
        `transform`, or moved as they are)."""
        batch["image"] = device_images(batch, transform, self.acc.device)
        batch["text"] = batch["text"].to(self.acc.device, non_blocking=True)

    def _outputs(self, batch: dict, ctx: TaskContext, forward: Any) -> dict:
        """The training forward on the batch's device inputs (the step's autocast)."""
        with self.acc.autocast():
            try:
                return forward(batch["image"], batch["text"])
            except ValueError as e:  # a batch BatchNorm cannot train on: one line
                if BN_MESSAGE not in str(e):
                    raise
                raise CvlError(batchnorm_message(ctx.task_name, batch["image"].shape[0])) from None

    def _terms(self, batch: dict, out: dict, ctx: TaskContext) -> tuple[dict, torch.Tensor]:
        """The method's loss terms (under the step's autocast) and their sum."""
        with self.acc.autocast():
            terms = self.method.loss(batch, out, ctx)
        if self.cfg.fsdp:  # a term reduced over sharded tensors (a penalty): its whole value
            terms = {k: fsdp.plain(v) for k, v in terms.items()}
        if not terms:
            raise CvlError(f"method '{self.cfg.method}' returned no loss terms")
        first, *rest = terms.values()
        return terms, sum(rest, first)  # (not `sum(terms)`: no 0 + first kernel)

    def _backward(self, loss: torch.Tensor) -> None:
        """The micro-batch's backward, its loss averaged over `grad_accum` micro-batches and
        scaled by fp16's GradScaler (Accelerate's `backward` without its division by 1)."""
        if self.cfg.grad_accum > 1:
            loss = loss / self.cfg.grad_accum
        scaler = self.acc.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def _update(
        self,
        ctx: TaskContext,
        opt: Any,
        params: list,
        clip: Any,
        reduce: Any,
        scaler: Any = None,
    ) -> Any:
        """Gradients averaged over ranks (`reduce`: the overlapped GradReducer's `finish`, or
        `average_gradients` for a probe, which leaves the reducer untouched), the method's
        `after_backward`, clipping (`clip`: torch's) and the optimizer step; the grad norm.

        `scaler` (fp16's GradScaler, the loop's): the gradients are unscaled once, before
        `after_backward`, so a method reads and adds to true gradients (EWC's penalty
        gradient, SI's path integral, ZSCL's L2) and clipping sees them too; the step then
        only checks for overflow (`scaler.step` does not unscale twice). Only this task's
        optimizer is unscaled (Accelerate's `unscale_gradients` would unscale every optimizer
        it was given, earlier tasks' too, which hold the same parameters).
        """
        reduce(params)
        if scaler is not None:
            scaler.unscale_(getattr(opt, "optimizer", opt))  # the AcceleratedOptimizer's own
        self.method.after_backward(ctx)
        gnorm = clip(params, self.cfg.grad_clip) if self.cfg.grad_clip > 0 else None
        # without a scaler, Accelerate's wrapper only forwards the step (after per-step checks)
        (opt if scaler is not None else getattr(opt, "optimizer", opt)).step()
        return gnorm

    def _params(self) -> list[torch.nn.Parameter]:
        """The parameters that train: the model's, then the method's own. Methods and tuning
        set `requires_grad` before the task's optimizer is made, so the loop takes this list
        once per task (`_task_params`), not at every step."""
        ps = [p for p in self.model.parameters() if p.requires_grad]
        return ps + [p for p in self.method.extra_parameters() if p.requires_grad]

    def _optimizer(self, steps: int, lr_lambda: Any = None, task: str | None = None):
        # the previous task's optimizer (and its moments) is freed before this task's is made
        self._opt = None
        fsdp.reshard(self.model)
        drop_optimizers(self.acc)
        self._task_params = self._params()
        opt, sched = optimizer_with_schedule(self._task_params, self.cfg, steps, lr_lambda, task)
        self._opt = self.acc.prepare_optimizer(opt, device_placement=False)
        return self._opt, sched

    def _train_task(self, ti: int, ctx: TaskContext, pos: dict | None) -> None:
        cfg, acc = self.cfg, self.acc
        name = self.order[ti]
        ctx.task_index, ctx.task_name, ctx.resuming = ti, name, pos is not None
        ctx.task_entries = self.entries_of(name)
        ctx.epoch, ctx.step, ctx.lr_lambda = 0, 0, None
        self._log_path = self.out / "logs" / f"{ti:02d}-{name}.jsonl"
        self._keeper: BestKeeper | None = None
        self.cost.begin_task(pos.get("cost") if pos else None)
        self._budget_rec: dict | None = None
        # task.json's counts: the items of its own it trains on (joint: the union of the
        # tasks), the buffer's before this task adds to it (the replayed ones) and after
        buffered = len(ctx.buffer) if ctx.buffer is not None else 0
        self._items = {"train_items": 0, "buffer_items_before": buffered}
        if not self.method.trains:
            self._no_step = f"method {cfg.method} does not train"
            self._finish_task(ti, ctx, [])
            return
        self.tuning.begin_task(self.model, self._tune_seed(ti))
        fsdp.reshard(self.model)  # --fsdp: hooks and the optimizer see the sharded parameters
        with self.cost.extra("before_task", skip=ctx.resuming):  # counted before a resume
            self.method.before_task(ctx)
        sel = selection_set(self.manifest, name, cfg.select, self.method)
        self._keeper = BestKeeper() if sel else None
        wants = cfg.select == "auto" and getattr(self.method, "selects_best_val", False)
        if wants and sel is None and acc.is_main_process:
            acc.print(f"note: no 'val' pairs for task {name}: {cfg.method} keeps the last weights")
        self._items["train_items"] = len(self.method.own_entries(ctx))
        gb = cfg.batch_size * acc.num_processes
        seed_task = sample_seed(cfg.seed, ti)
        block = int(cfg.shuffle_block or 1)
        order = -block if block > 1 and cfg.block_order == "fixed" else block  # cvl.data.order
        data = self._task_data = task_data(self.method, self.mixture, ctx, gb, seed_task, order)
        ds = PairDataset(
            data.entries,
            transform=train_transform(self.model.image_size, cfg.augment, acc.device),
            tokenize=self.model.tokenizer,
            skipped=Counter(self.skipped.get(name, {})),
            name=f"task {name}",
            window=block,
        )
        if block > 1 and ti == self.indices[0] and acc.is_main_process:
            acc.print(block_note(block, gb, cfg.block_order))
        steps = plan_steps(len(ds), cfg, acc.num_processes, data.per_epoch)  # cvl.train.plan
        check_plan(steps, name, cfg, stop_on_zero_steps=False)
        if steps.min_rows == 1 and needs_two_rows(self.model, acc.device):
            raise CvlError(batchnorm_message(name, 1))
        total = ctx.steps_in_task = steps.steps
        self._no_step = steps.why_no_step(cfg)  # said in task.json and on the console
        if self.budget is not None and total:  # the steps its budget buys (cvl.train.budget)
            total, self._budget_rec = plan_task(self, ctx, ds, gb, total, pos)
            ctx.steps_in_task = total
        elif cfg.compile and self.cost.enabled and not self.cost.has_step:
            measure_step(self, ctx, ds, gb)  # compiled graphs hide their ops: count eagerly
        count_step = self.cost.enabled and not self.cost.has_step
        where = task_position(self, ti, total)
        check_task_rates(cfg, where, name)  # the tasks not checked up front
        ctx.lr_lambda = lr_multiplier(cfg, where)  # --lr-schedule
        opt, sched = self._optimizer(total, ctx.lr_lambda, name)
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
        self._commit_run_json()  # a resumed run's run.json, once all it needs has loaded
        ctx.global_step = sum(self._steps_done_before(ti)) + ctx.step
        self.model.train()
        bar = progress_bar(
            total=total,
            initial=ctx.step,
            desc=f"task {ti + 1}/{len(self.order)} {name}",
            show=self.progress and acc.is_main_process,
            unit="step",
            dynamic_ncols=True,
        )
        usable = steps.usable_batches  # batches of an epoch that complete an optimizer step

        def plan():  # the global batches still to train, over all epochs (lazy), no more
            left = max(0, total - ctx.step) * cfg.grad_accum
            for e in range(epoch0, steps.epochs):
                for b in range((batch0 if e == epoch0 else 0), usable):
                    if left <= 0:
                        return
                    left -= 1
                    yield data.batch(e, b)  # computed when the loader asks: nothing stored

        # one loader (one set of workers) for the whole task: they prefetch across epoch ends
        planned = plan()
        if self._cache is not None:  # each rank's micro-batches: its slice of the step's batch
            planned = rank_major(planned, cfg.grad_accum, acc.num_processes)
        batches = iter(
            make_loader(
                ds,
                prefetching(ds, planned),  # --shard-cache: the coming batches' shards
                acc.process_index,
                acc.num_processes,
                self.workers,
                pin_memory=acc.device.type == "cuda",
            )
        )
        window = LogWindow(acc.device, 1 if self._cache is not None else cfg.grad_accum)
        params = self._task_params
        inner = getattr(opt, "optimizer", opt)  # zero_grad without Accelerate's per-step checks
        skip_mode = cfg.skip_nonfinite > 0  # a bad step must not update: read before each one

        def prepare(last: bool) -> None:  # before a backward: the reducer sends on the last
            self._reducer.prepare(params, last)

        done = ctx.step >= total
        for epoch in range(epoch0, steps.epochs):
            if done:
                break
            ctx.epoch = epoch
            start = batch0 if epoch == epoch0 else 0
            micro, losses = 0, []
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
                    window.begin_step(ctx.step + 1, opt.param_groups[0]["lr"], batch.get("id"))
                got = accumulate(self, batch, ctx, micro, ds.transform, self._forward, prepare)
                if got is not None:  # a loss ran its backward (cached: the step's, once)
                    window.add_micro(got[1], ctx.metrics, got[0])
                    if skip_mode:
                        losses.append(got[2])
                    ctx.metrics = {}
                micro += 1
                if micro < cfg.grad_accum:
                    continue
                micro = 0
                gnorm = None
                overflow = False
                skip_step = skip_mode and not self._step_finite(losses)
                if skip_step:  # the backward ran (its read came after it): drop its gradients
                    self._reducer.finish(params)
                    rec = window.current
                    n = window.grad_accum  # losses per step (cached: one)
                    bad = {k: sum(float(d[k]) for d in rec.terms) / n for k in rec.terms[0]}
                    self._nonfinite(bad, rec, ctx)
                    window.skip_step(bad)
                else:
                    gnorm = self._update(
                        ctx, opt, params, self._clip, self._reducer.finish, acc.scaler
                    )
                    overflow = acc.scaler is not None and bool(opt.step_was_skipped)  # fp16
                losses = []
                sched.step()
                inner.zero_grad(set_to_none=True)
                ctx.step += 1
                ctx.global_step += 1
                if not skip_step:
                    if not overflow:  # the scaler skipped the update: nothing moved
                        self.method.after_step(ctx)
                    window.add_step(gnorm)
                if count_step:
                    self.cost.stop_step()
                    count_step = False
                ckpt = bool(cfg.checkpoint_every) and ctx.step % cfg.checkpoint_every == 0
                if ctx.step % cfg.log_every == 0 or ctx.step >= total or ckpt:
                    self._flush_log(window, ctx, epoch, bar)
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
            fsdp.load_copy_(self.model, self._keeper.weights)  # the task ends with the best
            k = self._keeper
            self.acc.print(f"task {name}: keeping epoch {k.epoch + 1} (val Rm {k.score:.2f})")
        fsdp.reshard(self.model)
        with self.cost.extra("after_task"):
            self.method.after_task(ctx)
        self.tuning.end_task(self.model)  # LoRA/DoRA: merged, the checkpoint is plain weights
        if ctx.buffer is not None:
            with self.cost.extra("buffer_update"):
                ctx.buffer.update(name, ctx.task_entries, ctx)
        self._finish_task(ti, ctx, [])

    def _flush_log(self, window: LogWindow, ctx: TaskContext, epoch: int, bar: Any) -> None:
        """Reduce the window across ranks (one all_reduce per line) and log it.

        This is where a step with a NaN/Inf loss is found without `--skip-nonfinite` (each
        step's terms come back with the line's): the run stops there, naming that step, before
        the line or any checkpoint is written. Steps skipped for a non-finite loss
        (`--skip-nonfinite`) are not in the means; the line counts them as
        `nonfinite_skipped` (a line of skipped steps only shows the last one's terms).
        """
        n, skipped, dt = window.steps, window.skipped, window.seconds()
        bad_terms = window.skipped_terms
        lr = window.lr
        vals, per_step = window.reduce()
        hit = first_nonfinite(per_step)
        if hit is not None:
            self._nonfinite(hit[1], hit[0], ctx)  # past the allowance (0 here): stops
        rec = log_record(vals, n, skipped, bad_terms, lr, dt, ctx, epoch, self._task_data.sizes)
        self._log(rec, ctx)
        bar.update(n + skipped)
        bar.set_postfix(loss=f"{rec['loss']:.3f}")

    def _validate(self, set_name: str, ctx: TaskContext, epoch: int) -> None:
        """Score the model on the task's validation pairs; the keeper keeps the best weights."""
        with self.cost.extra("validation"):
            score = val_score(self.model, self.manifest, set_name, ctx.task_name, self.acc)
        self._keeper.offer(self.model, score, epoch, ctx.step)

    # -- files -------------------------------------------------------------------------------

    def _log(self, rec: dict[str, Any], ctx: TaskContext) -> None:
        if not self.acc.is_main_process:
            return
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if trackers(self.cfg.log_with):
            scalars = {f"{ctx.task_name}/{k}": v for k, v in rec.items() if isinstance(v, float)}
            self.acc.log(scalars, step=ctx.global_step)
