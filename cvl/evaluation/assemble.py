"""metrics.json from the per-checkpoint results: R matrices, continual and cumulative tables.

`evaluate_checkpoint` (checkpoint.py) gives one row per checkpoint; `build_metrics` lays the
rows out as one R matrix per metric (rows: the model after task i; columns: task j's sets),
the zero-shot row of the initial weights, the continual summaries of the leading square
(`continual.py`), CTP's cumulative matrices and so-far-vs-final curves, the benchmark tables,
and the protocol notes every report repeats.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from cvl import __version__
from cvl.errors import CvlError
from cvl.evaluation import continual, mtil
from cvl.evaluation.checkpoint import Checkpoint, pairs_set, zs_templates_note
from cvl.evaluation.fomo import fomo_summary
from cvl.evaluation.options import PRECISION_NOTES, EvalOptions
from cvl.evaluation.transfer import tic_table

EVAL_SCHEMA = "cvl.eval/1"

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
    # MTIL / X-TAIL's Transfer, Avg., Last of the zero-shot matrices (classification streams)
    from cvl.classtext import has_task_templates

    mtil_b = (
        mtil.block(matrices, columns, n_rows) if aligned and has_task_templates(manifest) else {}
    )
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
        "zs_templates": zs_templates_note(manifest, opts),
        "probe": f"logistic regression on <= {opts.probe_train} training images per task, C from "
        "{0.1, 1, 10, 100, 1000} on the val set, refit on train+val",
        "cumulative": "model after task i on the merged test set / query+gallery of tasks 0..k (k <= i)",
        "units": "percent; FR in percent of R[t][t]",
        "precision": f"{opts.precision}: {PRECISION_NOTES[opts.precision]}",
    }
    cfg = run_d.get("config") or {}
    out = {
        "schema": EVAL_SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cvl_version": __version__,
        "run": str(run),
        "run_name": run.name,
        "method": cfg.get("method"),
        "method_label": method_label(cfg, run),
        "stream": {"path": str(stream_path), "name": manifest.name, "source": manifest.source},
        "protocol": protocol,
        "settings": opts.report_fields(),  # compared before --compare reuses this file
        "tasks": columns,
        "rows": [c.label for c in task_cks],
        "has_init": init is not None,
        "metrics": keys,
        "matrices": matrices,
        "zero_shot_row": zs_row,
        "continual": cont,
        **({"mtil": mtil_b} if mtil_b else {}),
        "cumulative": cum_m,
        "so_far_vs_final": sofar,
        "final": final,
        "benchmarks": benchmark_tables(manifest, cks, results),
        # TiC-CLIP's ID / backward / forward transfer on the per-period retrieval sets
        "tic": tic_table(manifest, [(c.label, c.task) for c in cks], results),
        "folders": {
            c.label: results[c.label].get("folders", {})
            for c in cks
            if c.label in results and results[c.label].get("folders")
        },
        "details": {c.label: results[c.label]["info"] for c in cks if c.label in results},
        # where each checkpoint was evaluated (device, determinism, workers): no number depends
        # on it beyond float rounding; cached rows keep the values of the run that made them
        "runtime": {c.label: results[c.label].get("runtime") for c in cks if c.label in results},
    }
    out["fomo"] = fomo_summary(out)  # FoMo-in-Flux: knowledge accumulation, zero-shot retention
    return out


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
    """A short name for tables: method (+ the variant its arguments make, e.g. "joint
    (Oracle)", + buffer), else the run folder's name."""
    from cvl.methods.registry import get_method

    m = cfg.get("method")
    if not m:
        return run.name
    try:
        cls = get_method(str(m))
        v = cls.variant(cls.resolve_args(cfg.get("method_args") or {}))
    except CvlError:  # a method this version does not have, or no longer its arguments
        v = None
    name = f"{m} ({v})" if v else str(m)
    b = cfg.get("buffer")
    if not b:
        return name
    return f"{name}+{b}({cfg['buffer_size']})" if cfg.get("buffer_size") else f"{name}+{b}"
