"""The rotation analysis's result: one table per angle (`Table` of `Row`s, percentages that
sum to 100), `RotationResult` (rotation.json), `analyze_features` (features of checkpoints
0..K-1 -> the result), and the result as Markdown and CSV.

Between the angle maths (angles.py) and what uses a result (rotation_plots.py, the run
orchestration in rotation.py), so that plots and runs build on one result type without
importing each other. `cvl.analysis.rotation` re-exports every name.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cvl.analysis.angles import (
    DEFAULT_CHUNK_ELEMS,
    RAM_EDGES,
    SAM_EDGES,
    bin_labels,
    check_feats,
    checkpoint_pairs,
    histogram,
    imav_angles,
    paired_angles,
    retrieval_correct,
    sam_counts,
)
from cvl.errors import CvlError

SCHEMA = "cvl.rotation/1"


MODALITIES = ("vision", "text")


DEFINITIONS = {
    "sam": "|arccos<V_i^a,V_i^b> - arccos<V_j^a,V_j^b>| over sample pairs a<b "
    "(each unordered pair once, diagonal excluded): N(N-1)/2 values per row",
    "ram": "arccos<V_i^a, V_j^a> per sample a (same sample, two checkpoints)",
    "imav": "|angle(V_j^a, L_j^a) - angle(V_i^a, L_i^a)| over samples a that checkpoint i "
    "retrieves correctly (image->text top-1 within the eval set; a retrieved caption with "
    "identical text counts as correct); L = the sample's first caption",
    "pairs": "consecutive checkpoints (i, i+1) and first vs last (0, K-1)",
    "bins": "right-closed: [e0,e1], (e1,e2], ...; degrees",
    "numerics": "float64 angle math, cosines clamped to [-1, 1], features re-normalised",
}


# -- results ---------------------------------------------------------------------------------
def round_percentages(counts: Sequence[int], decimals: int = 2) -> list[float]:
    """Percentages rounded so that the rounded values sum to exactly 100 (largest remainder)."""
    n = sum(counts)
    if n == 0:
        return [math.nan] * len(counts)
    scale = 10**decimals
    exact = [c * 100 * scale / n for c in counts]
    floor = [math.floor(x) for x in exact]
    short = 100 * scale - sum(floor)
    order = sorted(range(len(counts)), key=lambda k: (floor[k] - exact[k], k))
    for k in order[:short]:
        floor[k] += 1
    return [f / scale for f in floor]


@dataclass
class Row:
    """One row of a table: the distribution between checkpoints `a` and `b`."""

    label: str
    a: str
    b: str
    counts: list[int]
    mean: float = math.nan

    @property
    def n(self) -> int:
        return int(sum(self.counts))

    @property
    def percent(self) -> list[float]:
        n = self.n
        return [100.0 * c / n if n else math.nan for c in self.counts]

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "from": self.a,
            "to": self.b,
            "n": self.n,
            "counts": list(self.counts),
            "percent": self.percent,
            "mean_deg": None if math.isnan(self.mean) else self.mean,
        }


TITLES = {
    "sam": "SAM: change of the included angle between two samples, |SAM_i - SAM_j|",
    "ram": "RAM: rotation angle of the same sample between two checkpoints",
    "imav": "ImAV: change of the image-text angle of the samples the earlier checkpoint retrieves correctly",
}


SYMBOLS = {"sam": "θ_SAM", "ram": "θ_RAM", "imav": "θ_ImAV"}


@dataclass
class Table:
    """A table in the papers' layout: rows = checkpoint pairs, columns = angle bins."""

    analysis: str  # sam | ram | imav
    modality: str  # vision | text | image-text
    edges: tuple[float, ...]
    rows: list[Row] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.analysis}_{self.modality}"

    @property
    def title(self) -> str:
        return f"{TITLES[self.analysis]} ({self.modality})"

    @property
    def n_label(self) -> str:
        return {"sam": "pairs", "ram": "samples", "imav": "correct"}[self.analysis]

    def to_json(self) -> dict[str, Any]:
        return {
            "analysis": self.analysis,
            "modality": self.modality,
            "edges": list(self.edges),
            "bins": bin_labels(self.edges),
            "rows": [r.to_json() for r in self.rows],
        }


@dataclass
class RotationResult:
    """Every table of one run's analysis plus what it was computed on."""

    checkpoints: list[dict[str, Any]]
    tables: list[Table]
    meta: dict[str, Any] = field(default_factory=dict)

    def table(self, key: str) -> Table | None:
        return next((t for t in self.tables if t.key == key), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            **self.meta,
            "checkpoints": self.checkpoints,
            "definitions": DEFINITIONS,
            "tables": [t.to_json() for t in self.tables],
        }


def analyze_features(
    labels: Sequence[str],
    vision: Sequence[torch.Tensor] | None = None,
    text: Sequence[torch.Tensor] | None = None,
    captions: Sequence[str] | None = None,
    modalities: Sequence[str] = MODALITIES,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    progress: bool = False,
) -> list[Table]:
    """SAM and RAM tables per modality (and ImAV when both are given) for checkpoints `labels`.

    vision[k] / text[k] are checkpoint k's [N, D] features of the same N samples, in the same
    order (text row a = sample a's caption).
    """
    pairs = checkpoint_pairs(len(labels))
    feats = {"vision": vision, "text": text}
    tables: list[Table] = []
    for mod in modalities:
        f = feats[mod]
        if f is None:
            continue
        if len(f) != len(labels):
            raise CvlError(f"{len(labels)} checkpoint labels but {len(f)} {mod} feature matrices")
        n, _ = check_feats(f)
        if n < 2:
            raise CvlError(f"the rotation analysis needs at least two samples, got {n}")
        counts, sums = sam_counts(f, pairs, SAM_EDGES, chunk_elems, progress, desc=f"SAM {mod}")
        sam = Table("sam", mod, SAM_EDGES)
        ram = Table("ram", mod, RAM_EDGES)
        for p, (a, b) in enumerate(pairs):
            la, lb = labels[a], labels[b]
            sam.rows.append(
                Row(
                    f"SAM_{{{la}-{lb}}}",
                    la,
                    lb,
                    counts[p].tolist(),
                    float(sums[p] / max(1, counts[p].sum())),
                )
            )
            ang = paired_angles(f[a], f[b])
            ram.rows.append(
                Row(
                    f"RAM_{{({la},{lb})}}",
                    la,
                    lb,
                    histogram(ang, RAM_EDGES).tolist(),
                    float(ang.mean()),
                )
            )
        tables += [sam, ram]
    if vision is not None and text is not None:
        imav = Table("imav", "image-text", SAM_EDGES)
        correct = {}
        for a, b in pairs:
            if a not in correct:
                correct[a] = retrieval_correct(vision[a], text[a], captions)
            ang = imav_angles(vision[a], text[a], vision[b], text[b], correct[a])
            mean = float(ang.mean()) if ang.numel() else math.nan
            la, lb = labels[a], labels[b]
            imav.rows.append(
                Row(f"ImAV_{{({la},{lb})}}", la, lb, histogram(ang, SAM_EDGES).tolist(), mean)
            )
        tables.append(imav)
    order = {"sam": 0, "ram": 1, "imav": 2}
    tables.sort(key=lambda t: order[t.analysis])
    return tables


# -- reports ---------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}%"


def table_markdown(t: Table) -> str:
    """The table in the papers' layout (percentages rounded to sum to exactly 100)."""
    head = [f"{SYMBOLS[t.analysis]} ∈", *bin_labels(t.edges), t.n_label, "mean"]
    lines = [f"#### {t.title}", "", "| " + " | ".join(head) + " |"]
    lines.append("|" + ":--|" + "--:|" * (len(head) - 1))
    for r in t.rows:
        cells = [r.label, *(_pct(x) for x in round_percentages(r.counts)), str(r.n)]
        cells.append("—" if math.isnan(r.mean) else f"{r.mean:.2f}°")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def legend_markdown(res: RotationResult) -> str:
    m = res.meta
    ev = m.get("eval", {})
    lines = [
        f"### Rotation analysis of run `{m.get('run', '?')}`",
        "",
        f"Eval set: stream `{ev.get('stream', '?')}`, split `{ev.get('split', '?')}`, task "
        f"`{ev.get('task', '?')}`, {ev.get('n_samples', '?')} samples. Checkpoints: "
        + ", ".join(f"{c['label']} = {c['description']}" for c in res.checkpoints)
        + ".",
        "",
        "SAM counts each sample pair a<b once (diagonal excluded); ImAV counts the samples the "
        "earlier checkpoint retrieves correctly (image->text top-1 within the set, identical "
        "caption text counts). Bins are right-closed; percentages sum to 100.",
    ]
    return "\n".join(lines)


def result_markdown(res: RotationResult) -> str:
    return "\n\n".join([legend_markdown(res), *(table_markdown(t) for t in res.tables)]) + "\n"


def table_csv(t: Table) -> str:
    """CSV: one row per checkpoint pair; percentages (sum 100), then raw counts."""
    labels = bin_labels(t.edges)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["row", "from", "to", "n", *labels, *(f"count {b}" for b in labels), "mean_deg"])
    for r in t.rows:
        pct = ["" if math.isnan(x) else f"{x:.2f}" for x in round_percentages(r.counts)]
        w.writerow(
            [r.label, r.a, r.b, r.n, *pct, *r.counts, "" if math.isnan(r.mean) else f"{r.mean:.4f}"]
        )
    return buf.getvalue()


# -- comparing two runs ----------------------------------------------------------------------
def compare_markdown(a: RotationResult, b: RotationResult, name_a: str, name_b: str) -> str:
    """Every table of both runs side by side: each cell reads 'A / B' (Mod-X Table 5 vs Fig. 10)."""
    lines = [
        f"### Rotation analysis: A = `{name_a}` vs B = `{name_b}`",
        "",
        "Each cell: percentage in run A / in run B (rows matched by label; — = absent).",
    ]
    ea, eb = a.meta.get("eval", {}), b.meta.get("eval", {})
    keys = ("stream", "split", "task", "n_samples")
    if any(ea.get(k) != eb.get(k) for k in keys):
        lines += [
            "",
            "**Warning:** the runs were analysed on different eval sets: "
            + f"A {[ea.get(k) for k in keys]}, B {[eb.get(k) for k in keys]}.",
        ]
    seen = []
    for t in a.tables + b.tables:
        if t.key not in seen:
            seen.append(t.key)
    for key in seen:
        ta, tb = a.table(key), b.table(key)
        t0 = ta or tb
        assert t0 is not None
        head = [f"{SYMBOLS[t0.analysis]} ∈ (A / B)", *bin_labels(t0.edges), f"{t0.n_label} (A / B)"]
        lines += ["", f"#### {t0.title}", "", "| " + " | ".join(head) + " |"]
        lines.append("|" + ":--|" + "--:|" * (len(head) - 1))
        ra = {r.label: r for r in ta.rows} if ta else {}
        rb = {r.label: r for r in tb.rows} if tb else {}
        labels = list(ra) + [lb for lb in rb if lb not in ra]
        for lab in labels:
            pa = round_percentages(ra[lab].counts) if lab in ra else None
            pb = round_percentages(rb[lab].counts) if lab in rb else None
            cells = [lab]
            for k in range(len(t0.edges) - 1):
                x = _pct(pa[k]) if pa else "—"
                y = _pct(pb[k]) if pb else "—"
                cells.append(f"{x} / {y}")
            na = str(ra[lab].n) if lab in ra else "—"
            nb = str(rb[lab].n) if lab in rb else "—"
            cells.append(f"{na} / {nb}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
