"""Evaluate a run folder: every checkpoint on every task's eval sets -> R matrices and more.

For each checkpoint (the initial weights `init/model.safetensors` when the trainer saved them,
then `tasks/NN-<task>/model.safetensors` in training order) and each task j of the stream:

- cross-modal retrieval on task j's test set (`retrieval.py`),
- multi-modal mAP@N of task j's queries against task j's gallery (`map.py`),
- zero-shot classification of task j's test images among task j's categories (`zeroshot.py`);
  on a class-incremental stream (a `class_map` in the manifest) also among *all* classes of
  the split (ZS-all-*), and in the cumulative sets among the classes seen so far (ZS-*) and
  all classes (ZS-all-*): IncCLIP's seen-vs-all protocol,
- a linear probe trained on (a subsample of) task j's training images (`probe.py`),

which fills R[i][j] for every metric. The CTP protocol adds, for the model after task i, the
same metrics on the *merged* test set (and query/gallery) of tasks 0..k for every k <= i: the
"so far" curve is k = i, the final model's row gives "final on the same merged set".

Results are cached per checkpoint in `eval/cache/<checkpoint>.json`, keyed by the checkpoint
file (size, mtime) and every option that changes a number; a re-run only evaluates what is new
(or everything with `force`). Distributed: every rank embeds its part of each set, features are
gathered (embed.py), metrics are computed on every rank, only the main process writes.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from cvl import __version__
from cvl.errors import CvlError
from cvl.evaluation import continual
from cvl.evaluation.embed import Embeddings, concat_embeddings, embed_dataset, eval_dataset
from cvl.evaluation.map import fuse_dual, map_at_n
from cvl.evaluation.probe import linear_probe
from cvl.evaluation.retrieval import DEFAULT_BLOCK_ELEMS, retrieval_metrics
from cvl.evaluation.zeroshot import (
    class_embeddings,
    load_templates,
    zeroshot_classify,
    zeroshot_folder,
)
from cvl.io import read_json, write_json
from cvl.runs import MODEL_FILE, finished_tasks, load_run

EVAL_SCHEMA = "cvl.eval/1"
CACHE_VERSION = 1
INIT_DIR = "init"

RETRIEVAL_KEYS = ["TR@1", "TR@5", "TR@10", "IR@1", "IR@5", "IR@10", "Rm", "TR@mean", "IR@mean"]
MAP_KEYS = [f"mAP@{n}{v}" for v in ("", "/code", "/pos") for n in (1, 5, 10)]
ZS_KEYS = ["ZS-top1", "ZS-top5", "ZS-all-top1", "ZS-all-top5"]
PROBE_KEYS = ["LP-top1"]
ALL_KEYS = RETRIEVAL_KEYS + MAP_KEYS + ZS_KEYS + PROBE_KEYS

MATCH_RULES = {
    "text": "a retrieved caption is a hit if its text is identical to one of the image's own "
    "captions (captions repeat inside a synthetic test set)",
    "pair": "a retrieved caption is a hit only if it was written for that image; an image is a "
    "hit if any of its captions is in the top K",
}
MAP_FEATURES = {
    "fusion": "the fusion encoder's [CLS] of (image, first caption), L2-normalised (CTP)",
    "image+text": "normalise(normalise(image embedding) + normalise(first-caption embedding)) "
    "(dual encoder: no fusion encoder)",
    "image": "the image embedding only",
    "text": "the first caption's embedding only",
}
AP_NOTE = (
    "mAP@N = eq. 11 of CTP: AP normalised by the number of positives found in the top N "
    "(P(k) = hits up to k / k); mAP@N/code = the public CTP code (top 10 of the gallery, query "
    "removed, window min(N, #category items)); mAP@N/pos = normalised by min(N, #positives)"
)


@dataclass
class EvalOptions:
    """Everything `cvl eval` can change; fields marked in `key_fields` enter the cache key."""

    stream: str | None = None
    tasks: str = "all"
    batch_size: int = 256
    match: str = "auto"  # auto | pair | text
    ties: str = "pessimistic"
    map_feature: str = "auto"  # auto | fusion | image+text | image | text
    zeroshot: bool = True
    zs_templates: str | None = None  # None: synthetic streams -> "synthetic", else "imagenet"
    zs_folders: tuple[str, ...] = ()
    probe: bool = True
    probe_train: int = 500
    init: bool = True
    cumulative: bool = True
    force: bool = False
    progress: bool = True
    block_elems: int = DEFAULT_BLOCK_ELEMS
    image_cache_mb: int = 1024
    extra: dict[str, Any] = field(default_factory=dict)

    def key_fields(self) -> dict[str, Any]:
        d = asdict(self)
        for k in (
            "tasks",
            "batch_size",
            "force",
            "progress",
            "block_elems",
            "init",
            "stream",
            "image_cache_mb",
        ):
            d.pop(k)
        d["zs_folders"] = [str(Path(f).absolute()) for f in self.zs_folders]
        return d


@dataclass(frozen=True)
class Checkpoint:
    """One row of the evaluation: the initial weights (index -1) or the model after a task."""

    index: int
    task: str | None
    path: Path

    @property
    def label(self) -> str:
        return INIT_DIR if self.index < 0 else f"{self.index:02d}-{self.task}"


# -- locating things ----------------------------------------------------------------------
def resolve_stream(run: Path, run_d: dict[str, Any], override: str | None) -> Path:
    """The stream folder: --stream, else run.json's path (as written, or relative to the run)."""
    if override:
        return Path(override)
    s = run_d.get("stream") or {}
    p = s.get("path") if isinstance(s, dict) else None
    if not p:
        cfg = run_d.get("config") or {}
        p = cfg.get("stream")
    if not p:
        raise CvlError(f"{run}/run.json names no stream; pass --stream")
    cands = [Path(p), run / p, run.parent / p]
    for c in cands:
        if (c / "stream.json").is_file():
            return c
    raise CvlError(f"stream of {run} not found at {p}; pass --stream (the stream folder)")


def stream_warnings(run_d: dict[str, Any], manifest: Any) -> list[str]:
    """Why the stream evaluated may not be the one the run was trained on (both fingerprints)."""
    from cvl.streams.manifest import MANIFEST, file_sha256

    s = run_d.get("stream") or {}
    trained = s.get("fingerprint")
    if trained is not None and trained != manifest.fingerprint:
        return [
            f"evaluating on a different stream than the run was trained on: trained on "
            f"{json.dumps(trained, sort_keys=True)}, evaluating "
            f"{json.dumps(manifest.fingerprint, sort_keys=True)}"
        ]
    sha = s.get("manifest_sha256")
    f = manifest.root / MANIFEST if manifest.root is not None else None
    if sha and f is not None and f.is_file() and file_sha256(f) != sha:
        return [
            f"{f} was rewritten since the run was trained (rebuilt in place?): same fingerprint "
            f"{json.dumps(trained, sort_keys=True)}, stream.json sha256 {sha[:12]} -> "
            f"{file_sha256(f)[:12]}"
        ]
    return []


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


# -- one checkpoint -------------------------------------------------------------------------
class ImageCache:
    """Decoded, transformed eval samples kept across checkpoints (all share one architecture,
    so one eval transform): the JPEGs of a set are decoded once per `cvl eval`, not once per
    checkpoint. Bounded by `budget_mb`; samples past the budget are decoded each time."""

    def __init__(self, budget_mb: int) -> None:
        self.budget = budget_mb * 2**20
        self.used = 0
        self.sets: dict[tuple, _MemoDataset] = {}

    def dataset(self, key: tuple, make: Any) -> Any:
        if key not in self.sets:
            self.sets[key] = _MemoDataset(make(), self)
        return self.sets[key]


class _MemoDataset(torch.utils.data.Dataset):
    def __init__(self, base: Any, cache: ImageCache) -> None:
        self.base, self.cache, self.items = base, cache, {}

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, Any]:
        it = self.items.get(i)
        if it is None:
            it = self.base[i]
            size = it["image"].numel() * it["image"].element_size()
            if self.cache.used + size <= self.cache.budget:
                self.items[i] = it
                self.cache.used += size
        return it

    @property
    def entries(self) -> list:
        return self.base.entries


class _Ctx:
    """Per-evaluation settings resolved from the manifest, options and model."""

    def __init__(
        self,
        manifest: Any,
        columns: list[str],
        opts: EvalOptions,
        model: Any,
        acc: Any,
        image_cache: ImageCache | None = None,
    ):
        self.m, self.columns, self.opts, self.model, self.acc = manifest, columns, opts, model, acc
        self.cache = image_cache
        self.match = match_rule(manifest, opts.match)
        feat = opts.map_feature
        if feat == "auto":
            feat = "fusion" if getattr(model, "has_fusion", False) else "image+text"
        if feat == "fusion" and not getattr(model, "has_fusion", False):
            raise CvlError("--map-feature fusion needs a model with a fusion encoder")
        self.map_feature = feat
        self.test_set = pairs_set(manifest, "test")
        self.val_set = pairs_set(manifest, "val", required=False)
        kinds = {n: e.kind for n, e in manifest.eval_sets.items()}
        self.query_set = next((n for n, k in kinds.items() if k == "query"), None)
        self.gallery_set = next((n for n, k in kinds.items() if k == "gallery"), None)
        self.templates = zs_templates_name(manifest, opts)

    def progress(self) -> bool:
        """Per-set bars: only on an interactive terminal (they are noise in logs)."""
        main = self.acc is None or self.acc.is_main_process
        return self.opts.progress and main and sys.stderr.isatty()

    def dataset(self, key: tuple, make: Any) -> Any:
        if self.cache is None:
            return make()
        return self.cache.dataset((self.model.image_size, *key), make)

    def embed(self, shards: list, desc: str, **kw: Any) -> Embeddings:
        ds = self.dataset(("eval", *map(str, shards)), lambda: eval_dataset(self.model, shards))
        return embed_dataset(
            self.model,
            ds,
            self.opts.batch_size,
            self.acc,
            progress=self.progress(),
            desc=desc,
            **kw,
        )


def match_rule(manifest: Any, match: str = "auto") -> str:
    """Retrieval hit rule: `auto` = identical caption text on synthetic streams, else the pair."""
    if match != "auto":
        return match
    return "text" if manifest.source == "synthetic" else "pair"


def pairs_set(manifest: Any, prefer: str, required: bool = True) -> str | None:
    """The eval set to use as `prefer` (test / val): that name if it is a pairs set."""
    es = manifest.eval_sets.get(prefer)
    if es is not None and es.kind == "pairs":
        return prefer
    if prefer == "test":
        pairs = [n for n, e in manifest.eval_sets.items() if e.kind == "pairs" and n != "val"]
        if pairs:
            return pairs[0]
    if required:
        raise CvlError(f"stream '{manifest.name}' has no '{prefer}' eval set of kind pairs")
    return None


def zs_templates_name(manifest: Any, opts: EvalOptions) -> str:
    if opts.zs_templates:
        return opts.zs_templates
    return "synthetic" if manifest.source == "synthetic" else "imagenet"


def _classes_of(manifest: Any, tasks: list[str], emb: list[Embeddings]) -> list[str]:
    """Class names: the tasks' declared categories (in order), plus any seen in the sets."""
    names: list[str] = []
    for t in tasks:
        for c in manifest.tasks[t].categories or []:
            if c not in names:
                names.append(c)
    for e in emb:
        for c in e.categories:
            if c is not None and c not in names:
                names.append(str(c))
    return names


def _map_features(ctx: _Ctx, e: Embeddings) -> torch.Tensor:
    f = ctx.map_feature
    if f == "fusion":
        return e.extra["fusion"]
    if f == "image":
        return e.image_features
    if f == "text":
        return e.text_features
    return fuse_dual(e.image_features, e.text_features)


def _subsample(n: int, m: int) -> list[int]:
    if n <= m:
        return list(range(n))
    return sorted(set(np.linspace(0, n - 1, m).round().astype(int).tolist()))


def _labelled(e: Embeddings) -> bool:
    return len({c for c in e.categories if c is not None}) >= 2


def _zs_ready(manifest: Any, e: Embeddings) -> bool:
    """Zero-shot needs >= 2 categories in the set, or a class map (classes beyond the set)."""
    if manifest.class_map:
        return any(c is not None for c in e.categories)
    return _labelled(e)


def _zs_all(e: Embeddings, cls_feats: dict[str, torch.Tensor], names: list[str]) -> dict:
    """Zero-shot of a set's images among every class of the split (class-incremental)."""
    return zeroshot_classify(
        e.image_features, e.categories, torch.stack([cls_feats[n] for n in names]), names
    )


@torch.no_grad()
def evaluate_checkpoint(
    model: Any,
    manifest: Any,
    columns: list[str],
    n_seen: int,
    opts: EvalOptions,
    accelerator: Any = None,
    image_cache: ImageCache | None = None,
) -> dict[str, Any]:
    """All metrics of one model: per task (R-matrix entries) and cumulative over tasks 0..k.

    `n_seen` = number of tasks the model was trained on (0 for the initial weights); the
    cumulative sets are the first 1..n_seen columns (CTP protocol).
    """
    ctx = _Ctx(manifest, columns, opts, model, accelerator, image_cache)
    per: dict[str, dict[str, Any]] = {t: {} for t in columns}
    info: dict[str, dict[str, Any]] = {t: {} for t in columns}
    # Test sets: retrieval + zero-shot.
    test: dict[str, Embeddings] = {}
    by_shards: dict[tuple[str, ...], Embeddings] = {}
    for t in columns:
        if t in manifest.eval_sets[ctx.test_set].tasks:
            shards = manifest.eval_shards(ctx.test_set, t)
            test[t] = ctx.embed(shards, f"{ctx.test_set}/{t}")
            by_shards[tuple(map(str, shards))] = test[t]
    for t, e in test.items():
        r = retrieval_metrics(
            e.image_features,
            e.text_features,
            e.text_to_image,
            e.captions,
            ctx.match,
            ties=opts.ties,
            block_elems=opts.block_elems,
        )
        info[t]["retrieval"] = {"n_images": r.pop("n_images"), "n_texts": r.pop("n_texts")}
        per[t].update(r)
    cls_feats: dict[str, torch.Tensor] = {}
    all_names = manifest.split_classes()  # class-incremental streams: every class of the split
    if opts.zeroshot and any(_zs_ready(manifest, e) for e in test.values()):
        templates = load_templates(ctx.templates)
        names = _classes_of(manifest, list(test), list(test.values()))
        have = set(names)
        names += [n for n in all_names if n not in have]
        cf = class_embeddings(model, manifest.prompt_names(names), templates, opts.batch_size)
        cls_feats = {n: cf[i] for i, n in enumerate(names)}
        for t, e in test.items():
            if not _zs_ready(manifest, e):
                continue
            tn = _classes_of(manifest, [t], [e])
            z = zeroshot_classify(
                e.image_features, e.categories, torch.stack([cls_feats[n] for n in tn]), tn
            )
            per[t]["ZS-top1"], per[t]["ZS-top5"] = z["top1"], z["top5"]
            info[t]["zeroshot"] = {k: z[k] for k in ("n", "n_skipped", "n_classes")}
            if all_names:
                z = _zs_all(e, cls_feats, all_names)
                per[t]["ZS-all-top1"], per[t]["ZS-all-top5"] = z["top1"], z["top5"]
                info[t]["zeroshot_all"] = {k: z[k] for k in ("n", "n_skipped", "n_classes")}
    # Benchmarks: eval sets of no task (DKR Setting-2's Flickr30K/COCO/EC, Mod-X's COCO(5K)),
    # retrieval only; a benchmark with the same shards as a task's test set reuses its features.
    bench: dict[str, dict[str, Any]] = {}
    for b in getattr(manifest, "benchmarks", None) or {}:
        shards = manifest.benchmark_shards(b)
        e = by_shards.get(tuple(map(str, shards)))
        if e is None:
            e = ctx.embed(shards, f"benchmark/{b}")
        bench[b] = retrieval_metrics(
            e.image_features,
            e.text_features,
            e.text_to_image,
            e.captions,
            ctx.match,
            ties=opts.ties,
            block_elems=opts.block_elems,
        )
    # Query / gallery: mAP.
    query: dict[str, Embeddings] = {}
    gallery: dict[str, Embeddings] = {}
    if ctx.query_set and ctx.gallery_set:
        kw = {
            "all_captions": False,
            "fusion": ctx.map_feature == "fusion",
            "texts": ctx.map_feature in ("image+text", "text"),
        }
        for t in columns:
            if (
                t in manifest.eval_sets[ctx.query_set].tasks
                and t in manifest.eval_sets[ctx.gallery_set].tasks
            ):
                query[t] = ctx.embed(
                    manifest.eval_shards(ctx.query_set, t), f"{ctx.query_set}/{t}", **kw
                )
                gallery[t] = ctx.embed(
                    manifest.eval_shards(ctx.gallery_set, t), f"{ctx.gallery_set}/{t}", **kw
                )
        for t in query:
            mres = _map(ctx, [query[t]], [gallery[t]])
            if mres is not None:
                info[t]["map"] = {
                    k: mres.pop(k)
                    for k in ("n_queries", "n_gallery", "n_no_positive", "n_unlabelled")
                }
                per[t].update(mres)
    # Linear probe: train subsample of each task, C chosen on its val set, scored on its test set.
    if opts.probe:
        for t, e in test.items():
            if not _labelled(e):
                continue
            p = _probe(ctx, t, e)
            if p is not None:
                per[t]["LP-top1"] = p["top1"]
                info[t]["probe"] = {k: v for k, v in p.items() if k != "top1"}
    # Cumulative (CTP): merged sets of the first k+1 tasks, k < n_seen.
    cum: dict[str, dict[str, Any]] = {}
    if opts.cumulative:
        for k in range(min(n_seen, len(columns))):
            seen = [t for t in columns[: k + 1] if t in test]
            if not seen:
                continue
            e = concat_embeddings([test[t] for t in seen])
            r = retrieval_metrics(
                e.image_features,
                e.text_features,
                e.text_to_image,
                e.captions,
                ctx.match,
                ties=opts.ties,
                block_elems=opts.block_elems,
            )
            r.pop("n_images"), r.pop("n_texts")
            if cls_feats and _zs_ready(manifest, e):
                names = _classes_of(manifest, seen, [test[t] for t in seen])
                z = zeroshot_classify(
                    e.image_features,
                    e.categories,
                    torch.stack([cls_feats[n] for n in names]),
                    names,
                )
                r["ZS-top1"], r["ZS-top5"] = z["top1"], z["top5"]
            if cls_feats and all_names and _zs_ready(manifest, e):
                z = _zs_all(e, cls_feats, all_names)
                r["ZS-all-top1"], r["ZS-all-top5"] = z["top1"], z["top5"]
            qs = [t for t in columns[: k + 1] if t in query]
            if qs:
                mres = _map(ctx, [query[t] for t in qs], [gallery[t] for t in qs])
                if mres is not None:
                    for kk in ("n_queries", "n_gallery", "n_no_positive", "n_unlabelled"):
                        mres.pop(kk)
                    r.update(mres)
            cum[str(k)] = {"tasks": seen, "metrics": r}
    return {
        "per_task": per,
        "info": info,
        "cumulative": cum,
        "benchmarks": bench,
        "protocol": {
            "match": ctx.match,
            "map_feature": ctx.map_feature,
            "zs_templates": ctx.templates,
        },
    }


def _map(ctx: _Ctx, qs: list[Embeddings], gs: list[Embeddings]) -> dict[str, Any] | None:
    q, g = concat_embeddings(qs), concat_embeddings(gs)
    if not any(c is not None for c in g.categories):
        return None
    return map_at_n(
        _map_features(ctx, q),
        _map_features(ctx, g),
        q.categories,
        g.categories,
        q.ids,
        g.ids,
        block_elems=max(1, ctx.opts.block_elems // 4),
    )


def _probe(ctx: _Ctx, task: str, test: Embeddings) -> dict[str, Any] | None:
    m = ctx.m
    from cvl.data.reader import PairDataset
    from cvl.data.transforms import image_transform

    def make() -> PairDataset:
        ds = PairDataset.from_shards(
            m.train_shards(task), transform=image_transform(ctx.model.image_size, train=False)
        )
        return ds.with_entries([ds.entries[i] for i in _subsample(len(ds), ctx.opts.probe_train)])

    ds = ctx.dataset(("probe-train", task, ctx.opts.probe_train), make)
    tr = embed_dataset(
        ctx.model,
        ds,
        ctx.opts.batch_size,
        ctx.acc,
        progress=ctx.progress(),
        desc=f"train/{task}",
        texts=False,
    )
    va = None
    if ctx.val_set and task in m.eval_sets[ctx.val_set].tasks:
        va = ctx.embed(m.eval_shards(ctx.val_set, task), f"{ctx.val_set}/{task}", texts=False)
    return linear_probe(
        tr.image_features,
        tr.categories,
        test.image_features,
        test.categories,
        va.image_features if va is not None else None,
        va.categories if va is not None else None,
    )


# -- the whole run -----------------------------------------------------------------------------
def _load_model(run_d: dict[str, Any], path: Path, device: Any) -> Any:
    from cvl.models import load_weights, model_from_config

    model = model_from_config(run_d["model"])
    load_weights(model, path)
    model.eval()
    return model.to(device)


def _columns(run_d: dict[str, Any], manifest: Any) -> list[str]:
    """Eval tasks: the run's training order (when the stream has those tasks), then the rest."""
    order = list((run_d.get("stream") or {}).get("task_order") or [])
    cols = [t for t in order if t in manifest.tasks]
    return cols + [t for t in manifest.task_order if t not in cols]


def evaluate_run(
    run: str | os.PathLike,
    opts: EvalOptions,
    accelerator: Any = None,
    out: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Evaluate (or load from cache) the run's checkpoints and build metrics.json's content."""
    from cvl.streams.manifest import load_manifest

    run = Path(run)
    run_d = load_run(run)
    stream_path = resolve_stream(run, run_d, opts.stream)
    manifest = load_manifest(stream_path)
    main = accelerator is None or accelerator.is_main_process
    if main:
        for line in stream_warnings(run_d, manifest):
            print(f"warning: {line}", file=sys.stderr)
    columns = _columns(run_d, manifest)
    cks = [c for c in checkpoints(run) if opts.init or c.index >= 0]
    todo = select(cks, opts.tasks, opts.init)
    out_dir = Path(out) if out else run / "eval"
    cache_dir = out_dir / "cache"
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    base_key = {
        "cache_version": CACHE_VERSION,
        "stream": {
            "fingerprint": manifest.fingerprint,
            "eval_sets": {n: e.to_json() for n, e in manifest.eval_sets.items()},
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
    image_cache = ImageCache(opts.image_cache_mb)
    bar = tqdm(cks, desc="checkpoints", disable=not (opts.progress and main), leave=False)
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
            model = _load_model(run_d, ck.path, device)
            res = evaluate_checkpoint(
                model, manifest, columns, ck.index + 1, opts, accelerator, image_cache
            )
            res["folders"] = {}
            if opts.zs_folders:
                tmpl = load_templates(opts.zs_templates or "imagenet")
                for f in opts.zs_folders:
                    res["folders"][str(f)] = zeroshot_folder(
                        model, f, tmpl, opts.batch_size, accelerator, opts.progress and main
                    )
            del model
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
    return metrics


def _matrix(
    rows: list[dict[str, Any] | None], columns: list[str], key: str
) -> list[list[float | None]]:
    return [[(r["per_task"].get(t, {}).get(key) if r else None) for t in columns] for r in rows]


def build_metrics(
    run: Path,
    run_d: dict[str, Any],
    stream_path: Path,
    manifest: Any,
    columns: list[str],
    cks: list[Checkpoint],
    results: dict[str, dict[str, Any]],
    opts: EvalOptions,
) -> dict[str, Any]:
    """metrics.json: R matrices, cumulative matrices, continual metrics, protocol notes."""
    task_cks = [c for c in cks if c.index >= 0]
    n_rows = len(task_cks)
    rows = [results.get(c.label) for c in task_cks]
    init = next((results.get(c.label) for c in cks if c.index < 0), None)
    keys = [
        k
        for k in ALL_KEYS
        if any(
            r and any(pt.get(k) is not None for pt in r["per_task"].values()) for r in [*rows, init]
        )
    ]
    matrices = {k: _matrix(rows, columns, k) for k in keys}
    zs_row = {k: _matrix([init], columns, k)[0] for k in keys} if init else None
    # Continual metrics need the diagonal: row i <-> column i (same task); the leading square.
    aligned = [c.task for c in task_cks] == columns[:n_rows]
    cont, sofar, cum_m, final = {}, {}, {}, {}
    if aligned and n_rows:
        for k in keys:
            sq = [row[:n_rows] for row in matrices[k][:n_rows]]
            cont[k] = continual.summary(sq, zs_row[k][:n_rows] if zs_row else None)
        cum_keys = sorted(
            {kk for r in rows if r for c in r["cumulative"].values() for kk in c["metrics"]},
            key=lambda x: ALL_KEYS.index(x) if x in ALL_KEYS else 999,
        )
        for k in cum_keys:
            C = [
                [
                    (
                        r["cumulative"].get(str(j), {}).get("metrics", {}).get(k)
                        if r and j <= i
                        else None
                    )
                    for j in range(n_rows)
                ]
                for i, r in enumerate(rows)
            ]
            cum_m[k] = C
            sofar[k] = continual.so_far_vs_final(C)
    # The final model on the merged test set of every task it has seen (CTP Table 1): also
    # for runs whose checkpoints do not line up with the tasks (joint: one, after the last).
    last = rows[-1] if rows else None
    if last and last["cumulative"]:
        final = dict(last["cumulative"][max(last["cumulative"], key=int)]["metrics"])
    protocol = {
        "test_set": pairs_set(manifest, "test"),
        "match": (next(iter(results.values()))["protocol"]["match"] if results else opts.match),
        "retrieval_rule": MATCH_RULES.get(
            next(iter(results.values()))["protocol"]["match"] if results else "pair"
        ),
        "ties": f"{opts.ties}: scores equal to the positive's (within 1e-6) rank "
        + ("before it" if opts.ties == "pessimistic" else "after it"),
        "map_feature": MAP_FEATURES.get(
            next(iter(results.values()))["protocol"]["map_feature"] if results else ""
        ),
        "ap_normalisation": AP_NOTE,
        "zs_templates": zs_templates_name(manifest, opts),
        "probe": f"logistic regression on <= {opts.probe_train} training images per task, C from "
        "{0.1, 1, 10, 100, 1000} on the val set, refit on train+val",
        "cumulative": "model after task i on the merged test set / query+gallery of tasks 0..k (k <= i)",
        "units": "percent; FR in percent of R[t][t]",
    }
    cfg = run_d.get("config") or {}
    return {
        "schema": EVAL_SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cvl_version": __version__,
        "run": str(run),
        "run_name": run.name,
        "method": cfg.get("method"),
        "method_label": method_label(cfg, run),
        "stream": {"path": str(stream_path), "name": manifest.name, "source": manifest.source},
        "protocol": protocol,
        "tasks": columns,
        "rows": [c.label for c in task_cks],
        "has_init": init is not None,
        "metrics": keys,
        "matrices": matrices,
        "zero_shot_row": zs_row,
        "continual": cont,
        "cumulative": cum_m,
        "so_far_vs_final": sofar,
        "final": final,
        "benchmarks": benchmark_tables(manifest, cks, results),
        "folders": {
            c.label: results[c.label].get("folders", {})
            for c in cks
            if c.label in results and results[c.label].get("folders")
        },
        "details": {c.label: results[c.label]["info"] for c in cks if c.label in results},
    }


def benchmark_tables(
    manifest: Any, cks: list[Checkpoint], results: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Per benchmark: its rows (init, then each task's checkpoint) and one list per metric."""
    out: dict[str, Any] = {}
    for b, bm in (getattr(manifest, "benchmarks", None) or {}).items():
        labels = [c.label for c in cks if c.label in results]
        vals = [(results[lab].get("benchmarks") or {}).get(b) for lab in labels]
        keys = [k for k in RETRIEVAL_KEYS if any(v and v.get(k) is not None for v in vals)]
        sizes = next((v for v in vals if v), {})
        out[b] = {
            "description": bm.description,
            "n_images": sizes.get("n_images"),
            "n_texts": sizes.get("n_texts"),
            "rows": labels,
            "metrics": {k: [v.get(k) if v else None for v in vals] for k in keys},
        }
    return out


def method_label(cfg: dict[str, Any], run: Path) -> str:
    """A short name for tables: method (+buffer), else the run folder's name."""
    m = cfg.get("method")
    if not m:
        return run.name
    b = cfg.get("buffer")
    return f"{m}+{b}({cfg.get('buffer_size')})" if b else str(m)
