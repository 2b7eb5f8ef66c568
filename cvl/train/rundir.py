"""The run folder side of `Trainer` (a mixin): run.json, the run lock, the overwrite and
resume checks, mid-task checkpoints in last/ and the finished tasks' folders.

Files (see `cvl/runs.py`): run.json, init/ (initial weights), tasks/NN-name/ (one per
finished task: model, method state, log), last/ (mid-task checkpoint, atomic), logs/.
"""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from cvl import __version__
from cvl.dist import broadcast_module
from cvl.errors import CvlError
from cvl.io import atomic_dir, read_json, recover_dir, write_json
from cvl.methods.base import TaskContext
from cvl.runs import MODEL_FILE, RUN_JSON, RUN_SCHEMA, task_dir
from cvl.streams.manifest import Manifest
from cvl.train import fsdp
from cvl.train.batchnorm import batchnorm_statistics
from cvl.train.checkpoint import load_state, load_torch, save_state, save_torch
from cvl.train.config import config_diff
from cvl.train.cost import accumulation_record, summarize_run
from cvl.train.optim import adamw_impl, optimizer_with_schedule
from cvl.train.schedules import schedule_record

LAST = "last"
METHOD_STATE = "method_state"
TUNE_STATE = "tune.safetensors"  # in last/: the adapters and base weights (--tune lora/dora)
BEST_MODEL = "best_model.safetensors"  # in last/: the best-on-validation weights so far


def stream_location(stream: str | Path) -> str:
    """run.json's stream: an absolute folder, or the URL of a served stream as given."""
    from cvl.data.index import is_remote

    return str(stream) if is_remote(str(stream)) else str(Path(stream).absolute())


def _manifest_sha(m: Manifest) -> str | None:
    """SHA-256 of the stream's stream.json: a stream rebuilt in place changes it (`created`)."""
    from cvl.streams.streamfiles import file_sha256, manifest_file

    f = manifest_file(m)
    return file_sha256(f) if f is not None else None


class RunFolder:
    """What `Trainer` reads and writes in its run folder (uses the trainer's attributes)."""

    def _run_json(self) -> dict[str, Any]:
        import accelerate
        import open_clip

        m = self.manifest
        return {
            "schema": RUN_SCHEMA,
            "config": self.cfg.to_json(),
            "model": self.model.config(),
            "stream": {
                "path": stream_location(self.cfg.stream),
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
            "lr_schedule": schedule_record(self),
            **(
                {"mixture": self.mixture.record(self.cfg.batch_size * self.acc.num_processes)}
                if self.mixture
                else {}
            ),
            "runtime": self._runtime(),
            "earlier_runtimes": getattr(self, "_earlier_runtimes", []),
        }

    def _runtime(self) -> dict[str, Any]:
        """Where and how reproducibly this session trains (main process's device)."""
        return {
            "device": str(self.acc.device),
            "deterministic": self.deterministic,
            "deterministic_source": "default" if self.cfg.deterministic is None else "option",
            "optimizer_impl": adamw_impl(self.cfg, self.acc.device),
            "batchnorm_statistics": batchnorm_statistics(self.model, self.acc.num_processes),
        }

    def _note_runtime_change(self, old: dict[str, Any]) -> None:
        """Keep the earlier sessions' runtimes that differ; say when determinism changes."""
        self._earlier_runtimes = list(old.get("earlier_runtimes") or [])
        self._notes: list[str] = getattr(self, "_notes", [])
        before, now = old.get("runtime"), self._runtime()
        # a key an older cvl did not record (batchnorm_statistics) is no change
        if not before or all(now[k] == v for k, v in before.items() if k in now):
            return
        self._earlier_runtimes.append(before)
        if before.get("deterministic") != now["deterministic"]:  # said when it trains (commit)
            flag = "--deterministic" if now["deterministic"] else "--no-deterministic"
            self._notes.append(
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
        prepare = getattr(self.method, "prepare_model", None)
        if prepare is not None:  # layers a method adds (MoE-Adapters): in run.json and init/
            self.model = prepare(self.model, self.manifest)
        self._sync_batchnorm()
        self.model.to(self.acc.device)
        broadcast_module(self.model)
        from cvl.models.tune import Tuning, with_defaults

        if cfg.base_loss == "class-ce":  # as the ZSCL code: the logit scale is never trained
            from cvl.methods.base import freeze_logit_scale

            freeze_logit_scale(self.model)
        tune_args = with_defaults(
            cfg.tune, getattr(self.method, "tune_defaults", {}), cfg.tune_args
        )
        self.tuning = Tuning(cfg.tune, tune_args)  # which parameters train (cvl.models.tune)
        self.tuning.apply(self.model, self._tune_seed(0), getattr(self.method, "tune_also", ()))
        from cvl.train.plan import batchnorm_message, needs_two_rows

        one = [t for t, p in getattr(self, "_plans", {}).items() if p.min_rows == 1]
        if one and needs_two_rows(self.model, self.acc.device):  # before anything is written
            raise CvlError(batchnorm_message(one[0], 1))
        rj = self.out / RUN_JSON
        self._history: list[dict[str, Any]] = []
        self._committed = False
        # a folder that never trained a step (refused or failed before its first checkpoint)
        # holds nothing to keep: a corrected command starts it again, not "another config"
        restart = rj.is_file() and self._never_trained()
        self.acc.wait_for_everyone()  # every rank has looked before rank 0 clears it
        if restart and self.acc.is_main_process:
            if config_diff(read_json(rj).get("config", {}), cfg.to_json()):
                self.acc.print(f"note: {self.out} never trained a step: starting it again")
            for sub in ("init", "logs"):
                shutil.rmtree(self.out / sub, ignore_errors=True)
            rj.unlink()
        if rj.is_file() and not restart:
            old = read_json(rj)
            oc = old.get("config", {})
            if "block_order" not in oc and int(oc.get("shuffle_block", 1) or 1) > 1:
                oc["block_order"] = cfg.block_order = "fixed"  # begun before blocks were re-cut
            diff = config_diff(oc, cfg.to_json())
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
            self._history = self._forced_history(old, diff)
            self._note_runtime_change(old)
            self.resumed = True
            if not (self.out / "init" / MODEL_FILE).is_file():  # written at commit, if at all
                from cvl.models.tune import plain_copy

                self._init_model = plain_copy(self.model).cpu()
        else:
            busy = self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir()))
            if busy and not restart:
                raise CvlError(
                    f"{self.out} exists and is not a cvl run folder; choose another --out"
                )
            self.resumed = False
        self.acc.wait_for_everyone()  # every rank has checked the folder before rank 0 writes
        if not self.resumed and self.acc.is_main_process:
            from cvl.models.tune import plain_copy

            # a new run writes run.json and init/ (these weights) once the method's setup has
            # passed too (`_run`): a refused setup leaves no run folder behind
            self._init_model = plain_copy(self.model).cpu()

    def _never_trained(self) -> bool:
        """Whether the run folder holds nothing trained: no finished task, no mid-task
        checkpoint (`last/`; a kill inside its swap leaves `.last.old-*`, restored by then)."""
        from cvl.runs import finished_tasks

        return not finished_tasks(self.out) and not (self.out / LAST).exists()

    def _commit_run_json(self) -> None:
        """Write run.json (config, --force changes, runtime) and a missing init/, once.

        A new run writes them at its start, once the method's setup has passed (everything
        the command line, the stream and the method can refuse is refused before a run
        folder exists). A resumed run writes them only once everything
        the resume needs has been loaded (the last finished task's method state; last/'s
        weights, optimizer, method state and best-val keeper: the loop calls this before the
        first step it trains), as checkpoints are built aside and swapped in:
        a refused or failed resume leaves the run folder as it was, and a run with nothing
        left to train writes nothing at all (it may sit on a read-only filesystem)."""
        if self._committed:
            return
        self._committed = True
        if not self.acc.is_main_process:
            return
        from cvl.io import make_dirs
        from cvl.models import save_weights

        make_dirs(self.out)
        history = self._history
        for note in getattr(self, "_notes", []):  # said once they hold (the resume has loaded)
            self.acc.print(note)
        write_json(
            self.out / RUN_JSON, {**self._run_json(), **({"changes": history} if history else {})}
        )
        if not (self.out / "init" / MODEL_FILE).is_file():
            with atomic_dir(self.out / "init", overwrite=True, retry="run") as tmp:
                save_weights(getattr(self, "_init_model", None) or self.model, tmp / MODEL_FILE)
        self._init_model = None  # written: the copy is not needed any more

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
        where = f"task {start}" + (f", step {pos['step']}" if pos is not None else "")
        self._notes = [f"--force: {', '.join(sorted(fields)) or 'stream'} changed from {where} on"]
        return history

    def _resume_point(self, indices: list[int], ctx: TaskContext) -> tuple[int, dict | None]:
        """First task to train and, if a mid-task checkpoint matches it, its position."""
        from cvl.models import load_weights

        done = [i for i in indices if (task_dir(self.out, i, self.order[i]) / MODEL_FILE).is_file()]
        if done:
            last_done = max(done)
            d = task_dir(self.out, last_done, self.order[last_done])
            load_weights(self.model, d / MODEL_FILE)
            st = load_state(d, METHOD_STATE)
            self._restore_method_state(st, ctx, where=d)
        if self.acc.is_main_process:
            recover_dir(self.out / LAST)  # a kill inside the last/ swap: the previous one
        self.acc.wait_for_everyone()
        start, pos = self._resume_at()  # a stale last/ (of a task since finished) is ignored
        self._check_processes(pos, bool(done))
        if start >= len(self.order) and self.acc.is_main_process:
            self.acc.print(
                f"{self.out}: all {len(self.order)} tasks already trained; nothing to do"
            )
        elif (done or pos) and self.acc.is_main_process:
            where = f"task {start} ({self.order[start]})" + (f", step {pos['step']}" if pos else "")
            self.acc.print(f"resuming {self.out} at {where}")
        return start, pos

    def _check_processes(self, pos: dict | None, trained: bool) -> None:
        """A resume under another process count: every file holds whole tensors (also under
        --fsdp), so the state allows it, but the global batch is --batch-size × processes,
        and last/'s position counts that task's global batches: a mid-task checkpoint resumes
        only with its own count (one line); between tasks the next ones train with the new
        global batch (said)."""
        n = self.acc.num_processes
        before = pos.get("processes", n) if pos is not None else n
        if pos is not None and before != n:
            raise CvlError(
                f"{self.out / LAST}: the mid-task checkpoint of task {pos.get('task')} was "
                f"written by {before} processes (a global batch of --batch-size × {before}); "
                f"resume it with {before} processes, or delete {self.out / LAST}/ to restart "
                f"that task with {n}"
            )
        rj = self.out / RUN_JSON
        old = read_json(rj).get("processes") if trained and rj.is_file() else None
        if old is not None and old != n and self.acc.is_main_process:
            self.acc.print(
                f"note: {self.out} trained with {old} processes so far, now {n}: the weights, "
                f"optimizer and method state are whole-model files, so it continues; the global "
                f"batch is now --batch-size × {n}"
            )

    def _restore_method_state(
        self, st: dict[str, Any], ctx: TaskContext, where: Path | None = None
    ) -> None:
        """Load a saved method (and buffer) state; from a finished task's folder (`where`), a
        state that does not fit this run is one line saying so (run.json is not yet
        rewritten at that point: the folder stays as it was)."""
        if not st:
            return
        st = fsdp.reshard_state(st, self.model)  # whole tensors -> this process's shards
        try:
            self.method.load_state_dict(st.get("method", {}))
            if ctx.buffer is not None and st.get("buffer"):
                ctx.buffer.load_state_dict(st["buffer"])
            scaler = getattr(self.acc, "scaler", None)
            if scaler is not None and scaler.is_enabled() and st.get("grad_scaler"):
                scaler.load_state_dict(st["grad_scaler"])
        except CvlError as e:
            if where is None:
                raise
            forced = ", without --force's changes" if getattr(self, "_forced", None) else ""
            raise CvlError(
                f"{where}: cannot resume from the method state saved there: {e}; nothing was "
                f"changed in {self.out}: rerun with the run's settings (run.json){forced}"
            ) from None

    def _method_state(self, ctx: TaskContext) -> dict[str, Any]:
        """The method's and buffer's state, and fp16's loss scale (the GradScaler's state: its
        scale carries over steps and tasks, so a resume restarting it at the initial scale
        would skip or keep other updates than the uninterrupted run)."""
        st: dict[str, Any] = {"method": self.method.state_dict()}
        if ctx.buffer is not None:
            st["buffer"] = ctx.buffer.state_dict()
        scaler = getattr(self.acc, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            st["grad_scaler"] = scaler.state_dict()
        # sharded state gathered whole for the main process, which writes it (every process
        # calls this)
        return fsdp.to_full(st, main_only=True)

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
            opt_state = load_torch(last / "optimizer.pt")
            if fsdp.is_sharded(self.model):
                opt_state = fsdp.optimizer_state_in(opt, opt_state)
            opt.load_state_dict(opt_state)
            sched.load_state_dict(load_torch(last / "scheduler.pt"))
            self._restore_method_state(load_state(last, METHOD_STATE), ctx)
        except Exception as e:  # noqa: BLE001 (torch, safetensors and JSON raise their own)
            why = " ".join(str(e).split())[:160] or type(e).__name__
            raise CvlError(
                f"{last}: the mid-task checkpoint of task {ctx.task_name} cannot be read "
                f"({why}); delete {last}/ to restart the task from its beginning "
                "(finished tasks are kept)"
            ) from None
        self._apply_forced_settings(opt, sched, total, ctx.lr_lambda, ctx.task_name)

    def _apply_forced_settings(
        self, opt: Any, sched: Any, total: int, lr_lambda: Any, task: str
    ) -> None:
        """After a --force resume that changed lr, min_lr, warmup, weight decay, betas or eps:
        this config's settings and schedule from the resumed step on (the loaded state holds
        the old ones). The optimizer's moments and the step count are kept."""
        from cvl.train.config import MIDTASK_KEYS

        if not (getattr(self, "_forced", set()) & MIDTASK_KEYS):
            return
        fresh, fresh_sched = optimizer_with_schedule(
            self._params(), self.cfg, total, lr_lambda, task
        )
        for g, f in zip(opt.param_groups, fresh.param_groups):
            g.update({k: v for k, v in f.items() if k != "params"})
        sched.base_lrs = list(fresh_sched.base_lrs)
        sched.lr_lambdas = fresh_sched.lr_lambdas
        for g, base, lam in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            g["lr"] = base * lam(sched.last_epoch)

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
        state = self._method_state(ctx)  # every rank computes it (gathers under --fsdp)
        cost = self.cost.state()  # collective: counts summed over ranks
        weights = fsdp.full_state(self.model)  # --fsdp: gathered (collective), else None
        sharded = weights is not None
        opt_state = fsdp.optimizer_state_out(opt) if sharded else opt.state_dict()
        keeper = getattr(self, "_keeper", None)
        best = keeper.weights if keeper is not None else None
        best = fsdp.to_full(best, main_only=True) if sharded and best is not None else best
        if self.acc.is_main_process:
            with atomic_dir(self.out / LAST, overwrite=True, retry="run") as tmp:
                save_weights(self.model, tmp / MODEL_FILE, state=weights)
                if self.tuning.adapters:
                    from safetensors.torch import save_file

                    save_file(self.tuning.state(self.model), str(tmp / TUNE_STATE))
                save_torch(tmp / "optimizer.pt", opt_state)
                save_torch(tmp / "scheduler.pt", sched.state_dict())
                save_state(tmp, METHOD_STATE, state)
                pos = {"task_index": ctx.task_index, "task": ctx.task_name, "step": ctx.step}
                pos["processes"] = self.acc.num_processes  # its batches are B × this
                pos["cost"] = cost
                if self._budget_rec is not None:
                    pos["budget"] = self._budget_rec
                if keeper is not None:
                    pos["best"] = keeper.info()
                    if best is not None:
                        from safetensors.torch import save_file

                        save_file(best, str(tmp / BEST_MODEL))
                write_json(tmp / "position.json", {**pos, **where})
        self.acc.wait_for_everyone()

    def _mixture_record(self) -> dict[str, Any]:
        """task.json's "mixture" (`--mixture`): items per global batch and held per source."""
        d = getattr(self, "_task_data", None)
        if d is None or not d.sizes:
            return {}
        return {"mixture": {"per_batch": d.sizes, "items": d.counts}}

    def _finish_task(self, ti: int, ctx: TaskContext, _: list) -> None:
        from cvl.models import save_weights

        self._check_weights(ctx)
        state = self._method_state(ctx)
        weights = fsdp.full_state(self.model)  # --fsdp: gathered (collective), else None
        gb = self.cfg.batch_size * self.acc.num_processes * self.cfg.grad_accum
        n = self.acc.num_processes
        cost = self.cost.task_record(ctx.step, gb, n, accumulation_record(self.cfg))  # collective
        budget = getattr(self, "_budget_rec", None)
        no_step = getattr(self, "_no_step", None) if ctx.step == 0 else None
        self._commit_run_json()
        if self.acc.is_main_process:
            d = task_dir(self.out, ti, self.order[ti])
            with atomic_dir(d, overwrite=True, retry="run") as tmp:
                save_weights(self.model, tmp / MODEL_FILE, state=weights)
                save_state(tmp, METHOD_STATE, state)
                if self._log_path.is_file():
                    shutil.copy(self._log_path, tmp / "train_log.jsonl")
                write_json(
                    tmp / "task.json",
                    {
                        "task": ctx.task_name,
                        "index": ti,
                        "steps": ctx.step,
                        **getattr(self, "_items", {}),
                        "buffer_items": len(ctx.buffer) if ctx.buffer is not None else 0,
                        **self._mixture_record(),
                        "trainable_params": self.tuning.trainable,
                        "skipped": getattr(self, "skipped", {}).get(ctx.task_name, {}),
                        **self._fault_counts(),
                        "selection": (
                            k.info() if (k := getattr(self, "_keeper", None)) else {"by": "last"}
                        ),
                        "cost": cost,
                        **({"budget": budget} if budget is not None else {}),
                        **({"no_optimizer_step": no_step} if no_step else {}),
                    },
                )
            rj = read_json(self.out / RUN_JSON)
            write_json(self.out / RUN_JSON, {**rj, "cost": summarize_run(self.out)})
            shutil.rmtree(self.out / LAST, ignore_errors=True)
            head = f"task {ti + 1}/{len(self.order)} {ctx.task_name}"
            if no_step:  # never "saved" as if it trained
                self.acc.print(
                    f"{head}: no optimizer step ({no_step}); {d} keeps its start weights"
                )
            else:
                self.acc.print(f"{head}: saved {d}")
        self.acc.wait_for_everyone()
