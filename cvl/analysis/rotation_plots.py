"""Plots of a rotation result (matplotlib, imported only when a plot is drawn): one bar chart
per angle (`plot_result`) and two runs side by side (`plot_compare`).

Kept apart from the result (rotation_results.py) and the run orchestration (rotation.py): the
plots are the only part that needs matplotlib. `cvl.analysis.rotation` re-exports every name.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from cvl.analysis.angles import (
    RAM_EDGES,
    bin_labels,
)
from cvl.analysis.rotation_results import (
    MODALITIES,
    RotationResult,
    Table,
)
from cvl.io import atomic_write_bytes


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
