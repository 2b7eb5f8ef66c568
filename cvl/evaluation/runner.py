"""Evaluate a run folder: every checkpoint on every task's eval sets -> R matrices and more.

The checkpoints are the initial weights `init/model.safetensors` when the trainer saved them,
then `tasks/NN-<task>/model.safetensors` in training order; each is evaluated by
`checkpoint.evaluate_checkpoint` (one row of every R matrix, its benchmarks and CTP's
cumulative sets) and the rows become metrics.json (`assemble.build_metrics`).

Where it runs: on `--device` (auto = CUDA when torch sees one), in one process, or on each
process of an `accelerate launch` / `torchrun` (every rank embeds its part of each set, the
features are gathered (embed.py), metrics are computed on every rank, only the main process
writes). Each set is decoded once per command (`imagestore.py`: the first checkpoint decodes
in `--workers` loader processes, the later ones reuse the kept tensors) and embedded once per
checkpoint (`features.py`).

Results are cached per checkpoint in `eval/cache/<checkpoint>.json`, keyed by the checkpoint
file (size, mtime) and every option that changes a number (`EvalOptions.key_fields`: the
precision of the embedding passes is one; device, workers and batch size are not); a re-run
only evaluates what is new (or everything with `force`). Within one `--compare`, a checkpoint
whose bytes another run already had under the same key (the runs' common initial weights, a
zero-shot run's unchanged copies) takes that run's result (`same`) instead of a second pass.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cvl.errors import CvlError
from cvl.evaluation.assemble import (
    ALL_KEYS,
    AP_NOTE,
    EVAL_SCHEMA,
    MAP_FEATURES,
    MAP_KEYS,
    MATCH_RULES,
    PROBE_KEYS,
    RETRIEVAL_KEYS,
    ZS_KEYS,
    benchmark_tables,
    build_metrics,
    method_label,
)
from cvl.evaluation.checkpoint import (
    INIT_DIR,
    Checkpoint,
    evaluate_checkpoint,
    match_rule,
    pairs_set,
    zs_templates_name,
)
from cvl.evaluation.features import EmbedSettings
from cvl.evaluation.imagestore import ImageStore
from cvl.evaluation.options import EvalOptions, resolve_workers
from cvl.evaluation.zeroshot import load_templates, zeroshot_folder
from cvl.io import read_json, write_json
from cvl.progress import progress_bar
from cvl.runs import MODEL_FILE, finished_tasks, load_run

__all__ = [  # what other modules import from here (one home each: the modules named above)
    "ALL_KEYS",
    "AP_NOTE",
    "EVAL_SCHEMA",
    "MAP_FEATURES",
    "MAP_KEYS",
    "MATCH_RULES",
    "PROBE_KEYS",
    "RETRIEVAL_KEYS",
    "ZS_KEYS",
    "Checkpoint",
    "EvalOptions",
    "benchmark_tables",
    "build_metrics",
    "checkpoints",
    "evaluate_checkpoint",
    "evaluate_run",
    "match_rule",
    "method_label",
    "pairs_set",
    "resolve_stream",
    "select",
    "stream_warnings",
    "zs_templates_name",
]

CACHE_VERSION = 1


# -- locating things ----------------------------------------------------------------------
def resolve_stream(run: Path, run_d: dict[str, Any], override: str | None) -> Path:
    """The stream folder: --stream, else run.json's path (as written, or relative to the run)."""
    from cvl.data.index import is_remote

    if override:
        return override if is_remote(override) else Path(override)
    s = run_d.get("stream") or {}
    p = s.get("path") if isinstance(s, dict) else None
    if not p:
        cfg = run_d.get("config") or {}
        p = cfg.get("stream")
    if not p:
        raise CvlError(f"{run}/run.json names no stream; pass --stream")
    if is_remote(p):
        return p
    cands = [Path(p), run / p, run.parent / p]
    for c in cands:
        if (c / "stream.json").is_file():
            return c
    raise CvlError(f"stream of {run} not found at {p}; pass --stream (the stream folder)")


def stream_warnings(run_d: dict[str, Any], manifest: Any) -> list[str]:
    """Why the stream evaluated may not be the one the run was trained on (both fingerprints)."""
    from cvl.streams.streamfiles import file_sha256, manifest_file

    s = run_d.get("stream") or {}
    trained = s.get("fingerprint")
    if trained is not None and trained != manifest.fingerprint:
        return [
            f"evaluating on a different stream than the run was trained on: trained on "
            f"{json.dumps(trained, sort_keys=True)}, evaluating "
            f"{json.dumps(manifest.fingerprint, sort_keys=True)}"
        ]
    sha = s.get("manifest_sha256")
    f = manifest_file(manifest)
    if sha and f is not None and file_sha256(f) != sha:
        return [
            f"{f} was rewritten since the run was trained (rebuilt in place?): same fingerprint "
            f"{json.dumps(trained, sort_keys=True)}, stream.json sha256 {sha[:12]} -> "
            f"{file_sha256(f)[:12]}"
        ]
    return []


def unfinished_note(run: Path, run_d: dict[str, Any]) -> str | None:
    """Why the run's last checkpoint is not its final model: the stream's last task, which
    every run trains last (a joint run: only), has no checkpoint yet (still training, or
    stopped); None for a finished run."""
    from cvl.runs import finished_tasks

    order = list((run_d.get("stream") or {}).get("task_order") or [])
    done = finished_tasks(run)
    if not order or not done or any(c.index == len(order) - 1 for c in done):
        return None
    last = f"{done[-1].index:02d}-{done[-1].name}"
    return (
        f"{run} is not finished (it is still training, or stopped): its last checkpoint, "
        f"{last}, is not the final model (that of task {len(order) - 1:02d}-{order[-1]}); "
        f"the final-model metrics are {last}'s"
    )


def checkpoints(run: Path) -> list[Checkpoint]:
    """The init checkpoint (when saved) and every finished task, in training order."""
    out = []
    init = run / INIT_DIR / MODEL_FILE
    if init.is_file():
        out.append(Checkpoint(-1, None, init))
    out += [Checkpoint(c.index, c.name, c.model_path) for c in finished_tasks(run)]
    return out


def select(cks: list[Checkpoint], spec: str, with_init: bool) -> list[Checkpoint]:
    """Checkpoints to evaluate now: all | last | comma list of task names or indices (+ init)."""
    tasks = [c for c in cks if c.index >= 0]
    if not tasks:
        raise CvlError(
            "no finished task checkpoint in this run yet (tasks/NN-<task>/model.safetensors)"
        )
    init = [c for c in cks if c.index < 0 and with_init]
    if spec == "all":
        return init + tasks
    if spec == "last":
        return [tasks[-1]]
    want = [w.strip() for w in spec.split(",") if w.strip()]
    if not want:  # '' would evaluate nothing and report only what the cache holds
        raise CvlError(f"--tasks {spec!r}: give all, last, or task names / indices (and init)")
    chosen = []
    for w in want:
        if w == INIT_DIR:
            if not [c for c in cks if c.index < 0]:
                raise CvlError("--tasks init: this run has no init/model.safetensors")
            chosen += [c for c in cks if c.index < 0]
            continue
        m = [c for c in tasks if w in (c.task, str(c.index), c.label)]
        if not m:
            raise CvlError(
                f"--tasks: no finished task '{w}' (have: {', '.join(c.task for c in tasks)})"
            )
        chosen += m
    return chosen


def _file_key(p: Path) -> dict[str, Any]:
    st = p.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _hash(d: Any) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _content_key(key: dict[str, Any], path: Path) -> str:
    """A checkpoint's cache key with its file's bytes (SHA-256) in place of its name, size and
    time: equal for two runs' identical weights evaluated the same way (same stream, columns,
    options, model config and tasks seen)."""
    from cvl.streams.streamfiles import file_sha256

    rest = {k: v for k, v in key.items() if k not in ("checkpoint", "file")}
    return _hash({**rest, "sha256": file_sha256(path)})


# -- the whole run -----------------------------------------------------------------------------
def _load_model(run_d: dict[str, Any], path: Path, device: Any, model: Any = None) -> Any:
    """The checkpoint's weights in `model` (the previous checkpoint's: every checkpoint of a
    run has the same architecture, so it is built, and randomly initialised, only once)."""
    from cvl.models import load_weights, model_from_config

    if model is None:
        model = model_from_config(run_d["model"]).to(device)
    load_weights(model, path)
    return model.eval()


def label_space_key(manifest: Any) -> dict[str, Any]:
    """What the zero-shot classifiers depend on beyond the fingerprint (class map, per-task
    classes and templates); empty for streams without them (their cache keys are unchanged)."""
    t = {
        n: {"categories": i.categories, "templates": i.extra.get("templates")}
        for n, i in manifest.tasks.items()
        if i.extra.get("templates")
    }
    return {
        **({"class_map": manifest.class_map} if manifest.class_map else {}),
        **({"task_templates": t} if t else {}),
    }


def _columns(run_d: dict[str, Any], manifest: Any) -> list[str]:
    """Eval tasks: the run's training order (when the stream has those tasks), then the rest."""
    order = list((run_d.get("stream") or {}).get("task_order") or [])
    cols = [t for t in order if t in manifest.tasks]
    return cols + [t for t in manifest.task_order if t not in cols]


def embed_settings(
    opts: EvalOptions, accelerator: Any = None, store: ImageStore | None = None
) -> EmbedSettings:
    """Where and how the embedding passes run: `opts.device` (or the launcher's), the loader
    workers (`opts.workers`, -1 = auto), the precision, and the image store (a new one of
    `opts.image_cache_mb` unless given: `--compare` shares one across runs)."""
    from cvl.device import resolve_device

    device = accelerator.device if accelerator is not None else resolve_device(opts.device)
    main = accelerator is None or accelerator.is_main_process
    return EmbedSettings(
        batch_size=opts.batch_size,
        device=device,
        accelerator=accelerator,
        num_workers=resolve_workers(opts.workers, accelerator),
        precision=opts.precision,
        progress=opts.progress and main,  # drawn on a terminal only (cvl.progress)
        store=store if store is not None else ImageStore(opts.image_cache_mb),
    )


def evaluate_run(
    run: str | os.PathLike,
    opts: EvalOptions,
    accelerator: Any = None,
    out: str | os.PathLike | None = None,
    store: ImageStore | None = None,
    same: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Evaluate (or load from cache) the run's checkpoints and build metrics.json's content.

    Runs on the accelerator's device under a multi-process launch, else on `opts.device`;
    `store` keeps decoded eval images across checkpoints (and across runs when shared);
    `same` (one dict for every run of a --compare) holds the results by checkpoint content
    and key, so identical checkpoints of several runs are evaluated once."""
    from cvl.streams.manifest import load_manifest

    run = Path(run)
    run_d = load_run(run)
    stream_path = resolve_stream(run, run_d, opts.stream)
    manifest = load_manifest(stream_path)
    main = accelerator is None or accelerator.is_main_process
    if main:
        for line in stream_warnings(run_d, manifest):
            print(f"warning: {line}", file=sys.stderr)
    unfinished = unfinished_note(run, run_d)
    if unfinished and main:
        print(f"warning: {unfinished}", file=sys.stderr)
    columns = _columns(run_d, manifest)
    cks = [c for c in checkpoints(run) if opts.init or c.index >= 0]
    todo = select(cks, opts.tasks, opts.init)
    out_dir = Path(out) if out else run / "eval"
    cache_dir = out_dir / "cache"
    settings = embed_settings(opts, accelerator, store)
    base_key = {
        "cache_version": CACHE_VERSION,
        "stream": {
            "fingerprint": manifest.fingerprint,
            "eval_sets": {n: e.to_json() for n, e in manifest.eval_sets.items()},
            **label_space_key(manifest),
        },
        "columns": columns,
        **(
            {"benchmarks": {n: b.to_json() for n, b in manifest.benchmarks.items()}}
            if getattr(manifest, "benchmarks", None)
            else {}
        ),
        "options": opts.key_fields(),
        "model": run_d.get("model"),
    }
    results: dict[str, dict[str, Any]] = {}
    evaluated, reused = [], []
    model = None
    bar = progress_bar(cks, desc="checkpoints", show=opts.progress and main, leave=False)
    for ck in bar:
        key = {
            **base_key,
            "checkpoint": ck.label,
            "file": _file_key(ck.path),
            "n_seen": ck.index + 1,
        }
        h = _hash(key)
        cfile = cache_dir / f"{ck.label}.json"
        cached = None
        if cfile.is_file() and not (opts.force and ck in todo):
            try:
                c = read_json(cfile)
                cached = c["result"] if c.get("key_hash") == h else None
            except (CvlError, KeyError, TypeError):
                cached = None
        if ck in todo and (cached is None or opts.force):
            bar.set_postfix_str(ck.label)
            t0 = time.perf_counter()
            content = _content_key(key, ck.path) if same is not None else None
            if content is not None and content in same:  # a copy: metrics may edit theirs
                res = {**copy.deepcopy(same[content]), "seconds": 0.0}
            else:
                model = _load_model(run_d, ck.path, settings.device, model)
                res = _evaluate_one(model, ck, manifest, columns, opts, settings, t0)
                res["same_as"] = f"{run}:{ck.label}"  # where the numbers were computed
                if content is not None:
                    same[content] = copy.deepcopy(res)
            if main:
                write_json(cfile, {"key_hash": h, "key": key, "result": res})
            results[ck.label] = res
            evaluated.append(ck.label)
        elif cached is not None:
            results[ck.label] = cached
            reused.append(ck.label)
    bar.close()
    metrics = build_metrics(run, run_d, stream_path, manifest, columns, cks, results, opts)
    metrics["evaluated"], metrics["reused_from_cache"] = evaluated, reused
    if unfinished:
        metrics["unfinished"] = unfinished
    # what differs from one invocation to the next (a resumed evaluation gives the same rest)
    metrics["timing"] = {
        "seconds": {lab: results[lab].get("seconds") for lab in evaluated},
        "image_store": settings.store.stats() if settings.store is not None else None,
    }
    return metrics


def _evaluate_one(
    model: Any,
    ck: Checkpoint,
    manifest: Any,
    columns: list[str],
    opts: EvalOptions,
    settings: EmbedSettings,
    t0: float,
) -> dict[str, Any]:
    """One checkpoint's results (the cache file's `result`), with where they were computed."""
    res = evaluate_checkpoint(model, manifest, columns, ck.index + 1, opts, settings)
    res["folders"] = {}
    if opts.zs_folders:
        tmpl = load_templates(opts.zs_templates or "imagenet")
        for f in opts.zs_folders:
            res["folders"][str(f)] = zeroshot_folder(
                model,
                f,
                tmpl,
                opts.batch_size,
                settings.accelerator,
                settings.progress,
                **settings.kwargs(),
            )
    acc = settings.accelerator
    res["runtime"] = {
        "device": str(settings.device),
        "processes": acc.num_processes if acc is not None else 1,
        "workers": settings.num_workers,
        "precision": settings.precision,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res
