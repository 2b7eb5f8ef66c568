"""Mod-X spatial-disorder analysis: SAM, RAM and ImAV angle-change distributions.

Definitions (Mod-X §3.2, appendices A.2 and B.2), for a fixed evaluation set of N samples
embedded by checkpoints 0..K-1 (L2-normalised features; angles in degrees):

- **SAM** (self-angle matrix) of checkpoint k in one modality: SAM_k[a, b] = arccos<V_k^a, V_k^b>.
  The table row SAM_{i-j} is the distribution of |SAM_i[a, b] - SAM_j[a, b]| over the sample
  pairs a < b: every unordered pair is counted once and the diagonal (a == b, always 0) is left
  out, so a row holds N(N-1)/2 values. Computed in row blocks of the upper triangle, float64,
  with histogram counts accumulated per block: the N x N matrix never exists at once.
- **RAM** (rotation angle) between checkpoints i and j: RAM_(i,j)[a] = arccos<V_i^a, V_j^a>,
  one value per sample, reported for vision and text side by side (Mod-X Fig. 3).
- **ImAV** (inter-modal angle variation, Mod-X B.2) between checkpoints i < j: over the samples
  that checkpoint i *retrieves correctly*, |angle(V_j^a, L_j^a) - angle(V_i^a, L_i^a)|, where
  L is the text embedding of the sample's (first) caption. "Retrieves correctly" = image->text
  top-1 within the evaluation set: the caption with the highest cosine to image a under
  checkpoint i is a's own caption, or a caption with identical text (captions repeat in
  generated and real test sets; a retrieved duplicate is a hit).

Rows compare consecutive checkpoints (i, i+1) and the first with the last (0, K-1), as in the
papers' tables. Numerics: features re-normalised in float64, cosines clamped to [-1, 1] before
arccos. Bins are right-closed exactly as the papers write them: [0,5], (5,10], ..., so an angle
of exactly 5 deg falls in the first bin (a 1e-9 deg tolerance absorbs float64 round-off).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cvl.errors import CvlError
from cvl.io import atomic_write_bytes, write_json
from cvl.progress import progress_bar

SCHEMA = "cvl.rotation/1"
SAM_EDGES: tuple[float, ...] = (0.0, 5.0, 10.0, 15.0, 20.0, 180.0)
RAM_EDGES: tuple[float, ...] = (0.0, 15.0, 20.0, 25.0, 30.0, 180.0)
EDGE_TOL = 1e-9  # degrees; a value within this of an edge counts as on the edge (right-closed)
DEFAULT_CHUNK_ELEMS = 1 << 23  # float64 elements held by one SAM block (~64 MB)
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


# -- binning ---------------------------------------------------------------------------------
def _fmt_edge(x: float) -> str:
    return f"{x:g}"


def bin_labels(edges: Sequence[float]) -> list[str]:
    """The papers' column names: '[0°, 5°]', '(5°, 10°]', ..."""
    out = []
    for k in range(len(edges) - 1):
        lo, hi = _fmt_edge(edges[k]), _fmt_edge(edges[k + 1])
        out.append(f"{'[' if k == 0 else '('}{lo}°, {hi}°]")
    return out


def histogram(values: torch.Tensor, edges: Sequence[float]) -> torch.Tensor:
    """Counts of `values` (degrees) in right-closed bins [e0,e1], (e1,e2], ... (int64)."""
    v = values.reshape(-1)
    n = v.numel()
    gt = [int((v > e + EDGE_TOL).sum()) for e in edges[1:-1]]
    counts = [n - gt[0]] + [gt[k - 1] - gt[k] for k in range(1, len(gt))] + [gt[-1]]
    return torch.tensor(counts, dtype=torch.long)


# -- angle math ------------------------------------------------------------------------------
def _unit64(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float64)
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def cos_to_deg(cos: torch.Tensor) -> torch.Tensor:
    """arccos in degrees of float64 cosines, clamped to [-1, 1] first (in place)."""
    return torch.rad2deg_(torch.arccos_(cos.clamp_(-1.0, 1.0)))


def paired_angles(a: torch.Tensor, b: torch.Tensor, chunk_rows: int = 8192) -> torch.Tensor:
    """Angle (deg, float64) between row k of `a` and row k of `b`, for every k."""
    if a.shape != b.shape:
        raise CvlError(
            f"paired angles need equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    out = torch.empty(a.shape[0], dtype=torch.float64)
    for s in range(0, a.shape[0], chunk_rows):
        e = s + chunk_rows
        out[s:e] = cos_to_deg((_unit64(a[s:e]) * _unit64(b[s:e])).sum(-1))
    return out


def checkpoint_pairs(k: int) -> list[tuple[int, int]]:
    """Consecutive pairs (i, i+1) and, with three or more checkpoints, first vs last."""
    if k < 2:
        raise CvlError(f"the rotation analysis needs at least two checkpoints, got {k}")
    pairs = [(i, i + 1) for i in range(k - 1)]
    if k > 2:
        pairs.append((0, k - 1))
    return pairs


def _check_feats(feats: Sequence[torch.Tensor]) -> tuple[int, int]:
    if not feats:
        raise CvlError("no feature matrices given")
    n, d = feats[0].shape
    for f in feats:
        if f.shape != (n, d):
            raise CvlError(f"feature matrices differ in shape: {tuple(f.shape)} vs {(n, d)}")
        if not torch.isfinite(f).all():
            raise CvlError("features contain NaN or inf (a diverged checkpoint?)")
    return n, d


def sam_counts(
    feats: Sequence[torch.Tensor],
    pairs: Sequence[tuple[int, int]],
    edges: Sequence[float] = SAM_EDGES,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    progress: bool = False,
    desc: str = "SAM",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram counts of |SAM_a - SAM_b| for each (a, b) in `pairs`, and their sums.

    feats[k] is checkpoint k's [N, D] feature matrix (one modality). Only pairs i < j of the
    upper triangle are counted (diagonal excluded): each row of the result sums to N(N-1)/2.
    Rows of the triangle are processed in blocks of about `chunk_elems` float64 values in
    total (for all checkpoints involved), so memory stays bounded for any N.
    Returns (counts [len(pairs), bins] int64, sums [len(pairs)] float64 for the mean).
    """
    n, _ = _check_feats(feats)
    need = sorted({k for p in pairs for k in p})
    nb = len(edges) - 1
    counts = torch.zeros(len(pairs), nb, dtype=torch.long)
    sums = torch.zeros(len(pairs), dtype=torch.float64)
    total = n * (n - 1) // 2
    with progress_bar(
        total=total, desc=desc, unit="pair", unit_scale=True, show=progress, leave=False
    ) as bar:
        s = 0
        while s < n - 1:
            cols = n - s
            rows = max(1, chunk_elems // (cols * (len(need) + 1)))
            e = min(n - 1, s + rows)  # the last sample has no partner j > i
            r = e - s
            ang = {}
            for k in need:
                x = _unit64(feats[k][s:])  # samples s..n-1; the block's rows are its first r
                ang[k] = cos_to_deg(x[:r] @ x.T)  # [r, cols]: column c is sample s + c
            tri = torch.ones(r, r, dtype=torch.bool).triu_(1)  # j > i inside the block
            for p, (a, b) in enumerate(pairs):
                d = (ang[a] - ang[b]).abs_()
                left, right = d[:, :r][tri], d[:, r:]
                counts[p] += histogram(left, edges) + histogram(right, edges)
                sums[p] += left.sum() + right.sum()
            bar.update(r * (n - 1) - (s + e - 1) * r // 2)
            s = e
    return counts, sums


def sam_counts_dense(
    feats: Sequence[torch.Tensor],
    pairs: Sequence[tuple[int, int]],
    edges: Sequence[float] = SAM_EDGES,
) -> torch.Tensor:
    """Reference: the same counts from full N x N matrices (small N only; used by tests)."""
    n, _ = _check_feats(feats)
    iu = torch.triu_indices(n, n, offset=1)
    sams = {}
    for k in {k for p in pairs for k in p}:
        x = _unit64(feats[k])
        sams[k] = cos_to_deg(x @ x.T)[iu[0], iu[1]]
    return torch.stack([histogram((sams[a] - sams[b]).abs(), edges) for a, b in pairs])


def retrieval_correct(
    image: torch.Tensor,
    text: torch.Tensor,
    captions: Sequence[str] | None = None,
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """Bool [N]: image a's top-1 caption within the set (image->text) is its own.

    With `captions`, a retrieved caption whose text equals a's caption also counts as a hit.
    Ties go to the lowest index (argmax).
    """
    n = image.shape[0]
    if text.shape[0] != n:
        raise CvlError(f"need one caption per image, got {n} images and {text.shape[0]} captions")
    top = torch.empty(n, dtype=torch.long)
    t = text.float()
    for s in range(0, n, chunk_rows):
        top[s : s + chunk_rows] = (image[s : s + chunk_rows].float() @ t.T).argmax(dim=1)
    own = top == torch.arange(n)
    if captions is None:
        return own
    if len(captions) != n:
        raise CvlError(f"{len(captions)} captions for {n} samples")
    return torch.tensor(
        [bool(o) or captions[int(j)] == captions[i] for i, (o, j) in enumerate(zip(own, top))]
    )


def imav_angles(
    img_a: torch.Tensor,
    txt_a: torch.Tensor,
    img_b: torch.Tensor,
    txt_b: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """|angle(V_b, L_b) - angle(V_a, L_a)| (deg) of the samples where `mask` is true."""
    return (paired_angles(img_b[mask], txt_b[mask]) - paired_angles(img_a[mask], txt_a[mask])).abs()


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
        n, _ = _check_feats(f)
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


def _matplotlib():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, t: Table, title: str | None = None) -> None:
    """Grouped bars: x = angle bins, one bar per checkpoint pair."""
    labels = bin_labels(t.edges)
    k = max(1, len(t.rows))
    width = 0.8 / k
    for i, r in enumerate(t.rows):
        xs = [j + (i - (k - 1) / 2) * width for j in range(len(labels))]
        ax.bar(
            xs,
            [0 if math.isnan(p) else p for p in r.percent],
            width,
            label=r.label.replace("_", " "),
        )
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("% of " + t.n_label)
    ax.set_ylim(0, 100)
    ax.set_title(title or t.title, fontsize=8)
    ax.legend(fontsize=6)


def plot_result(res: RotationResult, out: Path) -> list[Path]:
    """rotation_sam.png, rotation_ram.png (vision vs text per phase, Mod-X Fig. 3), rotation_imav.png."""
    plt = _matplotlib()
    written = []
    sams = [t for t in res.tables if t.analysis == "sam"]
    if sams:
        fig, axes = plt.subplots(1, len(sams), figsize=(6 * len(sams), 4), squeeze=False)
        for ax, t in zip(axes[0], sams):
            _bars(ax, t, f"SAM angle change ({t.modality})")
        fig.tight_layout()
        written.append(_save(fig, out / "rotation_sam.png", plt))
    rams = {t.modality: t for t in res.tables if t.analysis == "ram"}
    if rams:
        rows = next(iter(rams.values())).rows
        ncol = min(3, len(rows))
        nrow = -(-len(rows) // ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.5 * ncol, 3.2 * nrow), squeeze=False)
        labels = bin_labels(RAM_EDGES)
        mods = [m for m in MODALITIES if m in rams]
        width = 0.8 / len(mods)
        for p, ax in enumerate(axes.flat):
            if p >= len(rows):
                ax.axis("off")
                continue
            for i, m in enumerate(mods):
                r = rams[m].rows[p]
                xs = [j + (i - (len(mods) - 1) / 2) * width for j in range(len(labels))]
                ax.bar(xs, r.percent, width, label=m)
            ax.set_xticks(range(len(labels)), labels, fontsize=7)
            ax.set_ylim(0, 100)
            ax.set_ylabel("% of samples")
            ax.set_title(f"rotation {rows[p].a} → {rows[p].b}", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, out / "rotation_ram.png", plt))
    imav = res.table("imav_image-text")
    if imav is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        _bars(ax, imav, "ImAV: image-text angle change of correctly retrieved samples")
        fig.tight_layout()
        written.append(_save(fig, out / "rotation_imav.png", plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def write_result(res: RotationResult, out: str | os.PathLike, plots: bool = True) -> list[Path]:
    """rotation.json, rotation.md, rotation_<analysis>_<modality>.csv and PNG charts in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "rotation.json", res.to_json())
    atomic_write_bytes(out / "rotation.md", result_markdown(res).encode("utf-8"))
    written = [out / "rotation.json", out / "rotation.md"]
    for t in res.tables:
        p = out / f"rotation_{t.key}.csv"
        atomic_write_bytes(p, table_csv(t).encode("utf-8"))
        written.append(p)
    if plots:
        written += plot_result(res, out)
    return written


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


def plot_compare(
    a: RotationResult, b: RotationResult, name_a: str, name_b: str, out: Path
) -> list[Path]:
    """compare_<table>.png: the two runs' distributions in two panels with the same axes."""
    plt = _matplotlib()
    written = []
    for ta in a.tables:
        tb = b.table(ta.key)
        if tb is None:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        _bars(axes[0], ta, f"{name_a}: {ta.analysis.upper()} ({ta.modality})")
        _bars(axes[1], tb, f"{name_b}: {tb.analysis.upper()} ({tb.modality})")
        fig.tight_layout()
        written.append(_save(fig, out / f"compare_{ta.key}.png", plt))
    return written


# -- from a run folder -----------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """A set of weights of a run: the initial ones ('init') or those after task `index`."""

    label: str
    name: str
    index: int | None
    path: Path

    @property
    def description(self) -> str:
        if self.index is None:
            return "initial weights (init/)"
        return f"after task {self.name} (tasks/{self.index:02d}-{self.name})"

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "task": self.name if self.index is not None else None,
            "index": self.index,
            "path": str(self.path),
            "description": self.description,
        }


def run_checkpoints(
    run: str | os.PathLike, tasks: str | Sequence[str] | None = "all"
) -> list[Checkpoint]:
    """The run's checkpoints in training order: init (when present) then every finished task.

    `tasks`: "all" (default) or a list / comma-separated string of task indices or names,
    and/or "init"; the selection is returned in training order. "all" leaves out initial
    weights that are a random initialisation (run.json: no `pretrained`), whose angles to a
    trained model say nothing (Mod-X's first checkpoint is a trained CLIP_0); name "init"
    to include them anyway.
    """
    from cvl.runs import MODEL_FILE, finished_tasks

    run = Path(run)
    avail: list[Checkpoint] = []
    if (run / "init" / MODEL_FILE).is_file():
        avail.append(Checkpoint("init", "init", None, run / "init" / MODEL_FILE))
    avail += [Checkpoint(str(c.index), c.name, c.index, c.model_path) for c in finished_tasks(run)]
    if tasks is None or tasks == "all" or (not isinstance(tasks, str) and list(tasks) == ["all"]):
        sel = [c for c in avail if c.index is not None or not _random_init(run)]
    else:
        tokens = (
            [t.strip() for t in tasks.split(",")]
            if isinstance(tasks, str)
            else [str(t).strip() for t in tasks]
        )
        tokens = [t for t in tokens if t]
        picked = set()
        for tok in tokens:
            match = [
                c
                for c in avail
                if tok in (c.label, c.name)
                or (c.index is not None and tok == f"{c.index:02d}-{c.name}")
            ]
            if not match:
                have = ", ".join(
                    c.label if c.index is None else f"{c.index} ({c.name})" for c in avail
                )
                raise CvlError(f"{run}: no checkpoint '{tok}' (have: {have or 'none'})")
            if match[0].label in picked:
                raise CvlError(f"--tasks lists checkpoint '{tok}' twice")
            picked.add(match[0].label)
        sel = [c for c in avail if c.label in picked]
    if len(sel) < 2:
        raise CvlError(
            f"{run}: the rotation analysis needs at least two checkpoints, found "
            f"{len(sel)} ({', '.join(c.label for c in sel) or 'none'})"
        )
    return sel


def _random_init(run: Path) -> bool:
    """True when run.json says the run started from random weights (`pretrained` unset)."""
    try:
        cfg = json.loads((run / "run.json").read_text(encoding="utf-8")).get("config", {})
    except (OSError, ValueError):
        return False
    return "pretrained" in cfg and not cfg["pretrained"]


def resolve_stream(run: Path, run_json: dict[str, Any], stream: str | os.PathLike | None):
    """The stream manifest: --stream when given, else the path recorded in run.json."""
    from cvl.streams.manifest import MANIFEST, load_manifest

    if stream is not None:
        return load_manifest(stream, check_files=False)
    p = (run_json.get("stream") or {}).get("path")
    if not p:
        raise CvlError(f"{run}: run.json records no stream path; pass --stream PATH")
    cands = [Path(p)] if Path(p).is_absolute() else [Path(p), run / p]
    for c in cands:
        if (c / MANIFEST).is_file():
            return load_manifest(c, check_files=False)
    raise CvlError(f"{run}: its stream {p} was not found (moved?); pass --stream PATH")


@dataclass
class EvalFeatures:
    """Features of one fixed eval set under every selected checkpoint."""

    checkpoints: list[Checkpoint]
    vision: list[torch.Tensor]
    text: list[torch.Tensor]
    captions: list[str]
    ids: list[str]
    eval: dict[str, Any]


def extract_features(
    run: str | os.PathLike,
    stream: str | os.PathLike | None = None,
    split: str = "test",
    eval_task: str | None = None,
    tasks: str | Sequence[str] | None = "all",
    max_samples: int | None = None,
    batch_size: int = 256,
    progress: bool = False,
    *,
    device: str | torch.device = "auto",
    workers: int = -1,
    precision: str = "no",
    store: Any = None,
) -> EvalFeatures:
    """Embed the eval set (default: the run's first task's test set) with every checkpoint.

    On `device` (`cvl.device.resolve_device`: auto = CUDA when available), decoded by `workers`
    loader processes (-1 = auto) once: later checkpoints reuse the decoded images from `store`
    (an `ImageStore`; a new one unless given). `precision` as `cvl eval`'s."""
    from cvl.device import resolve_device
    from cvl.evaluation.embed import embed_dataset, eval_dataset
    from cvl.evaluation.imagestore import ImageStore
    from cvl.evaluation.options import DEFAULT_IMAGE_CACHE_MB, resolve_workers
    from cvl.models import load_weights, model_from_config
    from cvl.runs import load_run

    run = Path(run)
    run_json = load_run(run)
    cks = run_checkpoints(run, tasks)
    m = resolve_stream(run, run_json, stream)
    if eval_task is None:
        order = (run_json.get("stream") or {}).get("task_order") or m.task_order
        eval_task = order[0]
    shards = m.eval_shards(split, eval_task)
    for s in shards:
        if not Path(s).is_file():
            raise CvlError(
                f"stream '{m.name}': eval set '{split}', task '{eval_task}': missing shard {s}"
            )
    if max_samples is not None and max_samples < 2:
        raise CvlError(f"--max-samples must be at least 2, got {max_samples}")
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    n_workers = resolve_workers(workers)
    store = store if store is not None else ImageStore(DEFAULT_IMAGE_CACHE_MB)
    vision, text = [], []
    captions: list[str] = []
    ids: list[str] = []
    ds = None
    for ck in progress_bar(cks, desc="checkpoints", show=progress, leave=False):
        model = model_from_config(run_json["model"])
        load_weights(model, ck.path)
        model.eval().to(dev)
        if ds is None:
            ds = eval_dataset(model, shards, check=False)  # unreadable samples: left out below
            if max_samples is not None and len(ds) > max_samples:
                ds = ds.with_entries(ds.entries[:max_samples])
        emb = embed_dataset(
            model,
            ds,
            batch_size=batch_size,
            progress=progress,
            all_captions=False,
            desc=f"embed {ck.label}",
            device=dev,
            num_workers=n_workers,
            precision=precision,
            store=store,
        )
        if emb.text_features.shape[0] != emb.image_features.shape[0]:
            raise CvlError("expected one caption per sample from embed_dataset(all_captions=False)")
        vision.append(emb.image_features)
        text.append(emb.text_features)
        if not captions:
            captions, ids = list(emb.captions), list(emb.ids)
        del model
    assert ds is not None
    if len(ids) < 2:
        raise CvlError(
            f"eval set '{split}' of task '{eval_task}' has {len(ids)} readable sample(s); "
            "need at least 2"
        )
    info = {
        "stream": m.name,
        "stream_path": str(m.root),
        "split": split,
        "task": eval_task,
        "n_samples": len(ids),
        "device": str(dev),
        "workers": n_workers,
        "precision": precision,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    return EvalFeatures(cks, vision, text, captions, ids, info)


def analyze_run(
    run: str | os.PathLike,
    stream: str | os.PathLike | None = None,
    split: str = "test",
    eval_task: str | None = None,
    tasks: str | Sequence[str] | None = "all",
    modality: str = "both",
    max_samples: int | None = None,
    batch_size: int = 256,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    progress: bool = False,
    **embed_kw: Any,
) -> RotationResult:
    """Extract features of every selected checkpoint and compute all tables.

    modality: vision | text | both; ImAV (which needs both) is computed only with "both".
    `embed_kw`: `device`, `workers`, `precision`, `store` of `extract_features`.
    """
    if modality not in ("vision", "text", "both"):
        raise CvlError(f"--modality must be vision, text or both, got {modality!r}")
    f = extract_features(
        run, stream, split, eval_task, tasks, max_samples, batch_size, progress, **embed_kw
    )
    mods = MODALITIES if modality == "both" else (modality,)
    tables = analyze_features(
        [c.label for c in f.checkpoints],
        vision=f.vision if "vision" in mods else None,
        text=f.text if "text" in mods else None,
        captions=f.captions,
        modalities=mods,
        chunk_elems=chunk_elems,
        progress=progress,
    )
    meta = {"run": str(run), "eval": f.eval, "modality": modality}
    return RotationResult([c.to_json() for c in f.checkpoints], tables, meta)
