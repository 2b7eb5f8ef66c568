"""Every metric of one checkpoint: one row of each R matrix, its benchmarks and cumulative sets.

For the model and each task j of the stream:

- cross-modal retrieval on task j's test set (`retrieval.py`),
- multi-modal mAP@N of task j's queries against task j's gallery (`map.py`),
- zero-shot classification of task j's test images among task j's categories (`zeroshot.py`);
  on a class-incremental stream (a `class_map` in the manifest) also among *all* classes of
  the split (ZS-all-*), and in the cumulative sets among the classes seen so far (ZS-*) and
  all classes (ZS-all-*): IncCLIP's seen-vs-all protocol,
- a linear probe trained on (a subsample of) task j's training images (`probe.py`),

plus retrieval on each benchmark (eval sets of no task) and, for the CTP protocol, the same
metrics on the *merged* test set (and query/gallery) of tasks 0..k for every k < n_seen.
Every set is embedded once (`features.py`); the metrics reuse those features.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cvl.errors import CvlError
from cvl.evaluation.embed import Embeddings, concat_embeddings
from cvl.evaluation.features import CheckpointFeatures, EmbedSettings
from cvl.evaluation.map import fuse_dual, map_at_n
from cvl.evaluation.options import EvalOptions
from cvl.evaluation.probe import linear_probe
from cvl.evaluation.retrieval import DEFAULT_BLOCK_ELEMS, retrieval_metrics
from cvl.evaluation.zeroshot import grouped_class_embeddings, load_templates, zeroshot_classify

MAP_COUNTS = ("n_queries", "n_gallery", "n_no_positive", "n_unlabelled")


# The folder of the initial weights in a run (`init/model.safetensors`): the evaluation's row -1.
INIT_DIR = "init"


@dataclass(frozen=True)
class Checkpoint:
    """One row of the evaluation: the initial weights (index -1) or the model after a task."""

    index: int
    task: str | None
    path: Path

    @property
    def label(self) -> str:
        return INIT_DIR if self.index < 0 else f"{self.index:02d}-{self.task}"


class EvalContext:
    """What one checkpoint's evaluation needs: the stream's sets, the options, the model and
    its features (each set embedded once)."""

    def __init__(
        self,
        manifest: Any,
        columns: list[str],
        opts: EvalOptions,
        model: Any,
        settings: EmbedSettings | None = None,
    ) -> None:
        self.m, self.columns, self.opts, self.model = manifest, columns, opts, model
        self.settings = settings or EmbedSettings(opts.batch_size, precision=opts.precision)
        self.features = CheckpointFeatures(model, self.settings)
        self.device = self.settings.device  # similarity and ranking run there (None: the CPU)
        self.block_elems = opts.block_elems or DEFAULT_BLOCK_ELEMS
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
        self.same_prompt: dict[str, str] = {}  # set by `_zeroshot`

    def embed(self, shards: list, desc: str, **kw: Any) -> Embeddings:
        """Features of the eval set made of `shards` (see `CheckpointFeatures.pairs`)."""
        return self.features.pairs(shards, desc, **kw)

    def retrieval(self, e: Embeddings) -> dict[str, Any]:
        """TR/IR@K, Rm, R@mean of a set (similarity and ranking on the device, in blocks)."""
        return retrieval_metrics(
            e.image_features,
            e.text_features,
            e.text_to_image,
            e.captions,
            self.match,
            ties=self.opts.ties,
            block_elems=self.block_elems,
            device=self.device,
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
    """The template file for classes without templates of their own (`--zs-templates`)."""
    if opts.zs_templates:
        return opts.zs_templates
    return "synthetic" if manifest.source == "synthetic" else "imagenet"


def zs_templates_note(manifest: Any, opts: EvalOptions) -> str:
    """Which templates the zero-shot classifiers use, for the reports."""
    from cvl.classtext import has_task_templates, union_templates

    name = zs_templates_name(manifest, opts)
    if opts.zs_templates or not has_task_templates(manifest):
        return name
    u = union_templates(manifest)
    return "each task's own ensemble (stream.json)" + (
        f"; over all classes (ZS-all): {' | '.join(u)}" if u else ""
    )


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


def _map_features(ctx: EvalContext, e: Embeddings) -> torch.Tensor:
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


def _zs(
    e: Embeddings,
    cls_feats: dict[str, torch.Tensor],
    names: list[str],
    same: dict[str, str] | None = None,
) -> dict:
    """Zero-shot of a set's images among the classes `names`; `same`: a class whose prompts
    are those of another class -> that class (`cvl.classtext.same_prompt`), one class here."""
    cats = e.categories
    if same:
        cats = [same.get(c, c) if c is not None else None for c in cats]
        names = [n for n in names if n not in same]
    return zeroshot_classify(
        e.image_features, cats, torch.stack([cls_feats[n] for n in names]), names
    )


@torch.no_grad()
def evaluate_checkpoint(
    model: Any,
    manifest: Any,
    columns: list[str],
    n_seen: int,
    opts: EvalOptions,
    settings: EmbedSettings | None = None,
) -> dict[str, Any]:
    """All metrics of one model: per task (R-matrix entries) and cumulative over tasks 0..k.

    `n_seen` = number of tasks the model was trained on (0 for the initial weights); the
    cumulative sets are the first 1..n_seen columns (CTP protocol). `settings`: where and how
    the embedding passes run (default: the model's device, no workers, nothing kept).
    """
    ctx = EvalContext(manifest, columns, opts, model, settings)
    per: dict[str, dict[str, Any]] = {t: {} for t in columns}
    info: dict[str, dict[str, Any]] = {t: {} for t in columns}
    test = _test_sets(ctx, per, info)
    cls_feats, all_feats, all_names = _zeroshot(ctx, test, per, info)
    bench = _benchmarks(ctx)
    query, gallery = _query_gallery(ctx, per, info)
    if opts.probe:
        for t, e in test.items():
            if _labelled(e):
                p = _probe(ctx, t, e)
                if p is not None:
                    per[t]["LP-top1"] = p["top1"]
                    info[t]["probe"] = {k: v for k, v in p.items() if k != "top1"}
    cum = (
        _cumulative(ctx, n_seen, test, query, gallery, (cls_feats, all_feats), all_names)
        if opts.cumulative
        else {}
    )
    return {
        "per_task": per,
        "info": info,
        "cumulative": cum,
        "benchmarks": bench,
        "protocol": {
            "match": ctx.match,
            "map_feature": ctx.map_feature,
            "zs_templates": zs_templates_note(manifest, opts),
            **({"zs_all_same_prompt": ctx.same_prompt} if ctx.same_prompt else {}),
        },
    }


def _test_sets(ctx: EvalContext, per: dict, info: dict) -> dict[str, Embeddings]:
    """Each task's test set embedded (with every caption) and scored for retrieval."""
    test: dict[str, Embeddings] = {}
    for t in ctx.columns:
        if t in ctx.m.eval_sets[ctx.test_set].tasks:
            test[t] = ctx.embed(ctx.m.eval_shards(ctx.test_set, t), f"{ctx.test_set}/{t}")
    for t, e in test.items():
        r = ctx.retrieval(e)
        info[t]["retrieval"] = {"n_images": r.pop("n_images"), "n_texts": r.pop("n_texts")}
        per[t].update(r)
    return test


def _zeroshot(
    ctx: EvalContext, test: dict[str, Embeddings], per: dict, info: dict
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]]:
    """Zero-shot of each labelled test set among its task's classes (ZS-*: the MTIL matrix)
    and, on a stream with a class map, among all classes of all tasks (ZS-all-*: IncCLIP's
    all-classes protocol, RAIL's X-TAIL). Each class is embedded with its task's templates
    when the stream has them (`--zs-templates` overrides), the all-classes classifier with the
    class map's `union_templates` when given. Returns the class embeddings of the per-task and
    of the all-classes classifiers, and the class map's class names."""
    from cvl.classtext import category_templates, union_templates

    m, cls_feats = ctx.m, {}
    all_names = m.split_classes()  # class-incremental streams: every class of the split
    if not (ctx.opts.zeroshot and any(_zs_ready(m, e) for e in test.values())):
        return cls_feats, cls_feats, all_names
    default = load_templates(ctx.templates)
    explicit = bool(ctx.opts.zs_templates)
    names = _classes_of(m, list(test), list(test.values()))
    have = set(names)
    names += [n for n in all_names if n not in have]
    per_class = [tuple(default)] * len(names) if explicit else category_templates(m, names, default)
    bs, prec = ctx.opts.batch_size, ctx.opts.precision
    cf = grouped_class_embeddings(ctx.model, m.prompt_names(names), per_class, bs, prec)
    cls_feats = {n: cf[i] for i, n in enumerate(names)}
    union = None if explicit else union_templates(m)
    all_feats = cls_feats
    if all_names and union:
        uf = grouped_class_embeddings(
            ctx.model, m.prompt_names(all_names), [tuple(union)] * len(all_names), bs, prec
        )
        all_feats = {n: uf[i] for i, n in enumerate(all_names)}
    # classes of several tasks with one prompt under the stream's own templates (found by the
    # build: `cvl.classtext.same_prompt`) are one class of the all-classes classifier
    ctx.same_prompt = {} if explicit else dict((m.class_map or {}).get("same_prompt") or {})
    for t, e in test.items():
        if not _zs_ready(m, e):
            continue
        z = _zs(e, cls_feats, _classes_of(m, [t], [e]))
        per[t]["ZS-top1"], per[t]["ZS-top5"] = z["top1"], z["top5"]
        info[t]["zeroshot"] = {k: z[k] for k in ("n", "n_skipped", "n_classes")}
        if all_names:
            z = _zs(e, all_feats, all_names, ctx.same_prompt)
            per[t]["ZS-all-top1"], per[t]["ZS-all-top5"] = z["top1"], z["top5"]
            info[t]["zeroshot_all"] = {k: z[k] for k in ("n", "n_skipped", "n_classes")}
    return cls_feats, all_feats, all_names


def _benchmarks(ctx: EvalContext) -> dict[str, dict[str, Any]]:
    """Retrieval on the benchmarks: eval sets of no task (DKR Setting-2's Flickr30K/COCO/EC,
    Mod-X's COCO(5K)); one with the same shards as a task's test set reuses its features."""
    bench: dict[str, dict[str, Any]] = {}
    for b in getattr(ctx.m, "benchmarks", None) or {}:
        bench[b] = ctx.retrieval(ctx.embed(ctx.m.benchmark_shards(b), f"benchmark/{b}"))
    return bench


def _query_gallery(
    ctx: EvalContext, per: dict, info: dict
) -> tuple[dict[str, Embeddings], dict[str, Embeddings]]:
    """Each task's query and gallery sets embedded (first caption) and scored for mAP."""
    query: dict[str, Embeddings] = {}
    gallery: dict[str, Embeddings] = {}
    if not (ctx.query_set and ctx.gallery_set):
        return query, gallery
    kw = {
        "all_captions": False,
        "fusion": ctx.map_feature == "fusion",
        "texts": ctx.map_feature in ("image+text", "text"),
    }
    m = ctx.m
    for t in ctx.columns:
        if t in m.eval_sets[ctx.query_set].tasks and t in m.eval_sets[ctx.gallery_set].tasks:
            qs, gs = m.eval_shards(ctx.query_set, t), m.eval_shards(ctx.gallery_set, t)
            query[t] = ctx.embed(qs, f"{ctx.query_set}/{t}", **kw)
            gallery[t] = ctx.embed(gs, f"{ctx.gallery_set}/{t}", **kw)
    for t in query:
        mres = _map(ctx, [query[t]], [gallery[t]])
        if mres is not None:
            info[t]["map"] = {k: mres.pop(k) for k in MAP_COUNTS}
            per[t].update(mres)
    return query, gallery


def _cumulative(
    ctx: EvalContext,
    n_seen: int,
    test: dict[str, Embeddings],
    query: dict[str, Embeddings],
    gallery: dict[str, Embeddings],
    feats: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    all_names: list[str],
) -> dict[str, dict[str, Any]]:
    """CTP's protocol: the merged sets of the first k+1 tasks, k < n_seen (no new pass);
    `feats`: the class embeddings of the per-task and of the all-classes classifiers."""
    cls_feats, all_feats = feats
    cum: dict[str, dict[str, Any]] = {}
    columns, m = ctx.columns, ctx.m
    for k in range(min(n_seen, len(columns))):
        seen = [t for t in columns[: k + 1] if t in test]
        if not seen:
            continue
        e = concat_embeddings([test[t] for t in seen])
        r = ctx.retrieval(e)
        r.pop("n_images"), r.pop("n_texts")
        if cls_feats and _zs_ready(m, e):
            z = _zs(e, cls_feats, _classes_of(m, seen, [test[t] for t in seen]))
            r["ZS-top1"], r["ZS-top5"] = z["top1"], z["top5"]
            if all_names:
                z = _zs(e, all_feats, all_names, ctx.same_prompt)
                r["ZS-all-top1"], r["ZS-all-top5"] = z["top1"], z["top5"]
        qs = [t for t in columns[: k + 1] if t in query]
        if qs:
            mres = _map(ctx, [query[t] for t in qs], [gallery[t] for t in qs])
            if mres is not None:
                for kk in MAP_COUNTS:
                    mres.pop(kk)
                r.update(mres)
        cum[str(k)] = {"tasks": seen, "metrics": r}
    return cum


def _map(ctx: EvalContext, qs: list[Embeddings], gs: list[Embeddings]) -> dict[str, Any] | None:
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
        block_elems=max(1, ctx.block_elems // 4),
        device=ctx.device,
    )


def _probe(ctx: EvalContext, task: str, test: Embeddings) -> dict[str, Any] | None:
    """Linear probe: a training subsample of the task, C chosen on its val set, its test set."""
    m = ctx.m
    from cvl.data.reader import PairDataset
    from cvl.data.selection import task_dataset
    from cvl.data.transforms import EvalTransform

    def make() -> PairDataset:
        ds = task_dataset(m, task, transform=EvalTransform(ctx.model.image_size))
        return ds.with_entries([ds.entries[i] for i in _subsample(len(ds), ctx.opts.probe_train)])

    key = ("probe-train", task, ctx.opts.probe_train)
    tr = ctx.features.dataset(key, make, f"train/{task}", texts=False)
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
