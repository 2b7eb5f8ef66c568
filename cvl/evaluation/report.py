"""Reports from metrics.json: paper-style Markdown tables, CSV files, heatmaps and curves.

Tables (all values in percent):

1. Final model on the merged test set of all tasks (CTP Table 1): TR@1/5/10, IR@1/5/10, Rm,
   mAP@1/5/10.
2. So far vs final (CTP Fig. 4 / Table 1): per step i, the model after task i on the merged
   test set of tasks 0..i, and the final model on the same set.
3. Per task, final model (DHA Table 1): R@mean and Forgetting Rate per direction.
4. Continual summary per metric: average final, BWT (IncCLIP), BWT (standard), forgetting,
   average FR (DHA), FWT (when the initial weights were evaluated).
5. R matrices (rows: model after task i, or the initial weights; columns: task j's test set).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cvl.evaluation.fomo import table_fomo
from cvl.evaluation.markdown import fmt, md_table
from cvl.io import atomic_write_bytes, write_json

MATRIX_METRICS_MTIL = ["ZS-all-top1"]  # X-TAIL's matrix, shown when a run has it

TABLE1 = ["TR@1", "TR@5", "TR@10", "IR@1", "IR@5", "IR@10", "Rm", "mAP@1", "mAP@5", "mAP@10"]
SUMMARY_METRICS = [
    "Rm",
    "TR@1",
    "IR@1",
    "TR@mean",
    "IR@mean",
    "mAP@1",
    "mAP@5",
    "mAP@10",
    "ZS-top1",
    "ZS-top5",
    "ZS-all-top1",
    "LP-top1",
]
MATRIX_METRICS = ["Rm", "TR@1", "IR@1", "mAP@1", "ZS-top1", "LP-top1"]
CURVE_METRICS = ["Rm", "TR@mean", "IR@mean", "mAP@1", "ZS-top1", "LP-top1"]
CONTINUAL_COLS = [
    ("average_final", "avg final"),
    ("bwt_incclip", "BWT (IncCLIP)"),
    ("bwt_standard", "BWT"),
    ("forgetting", "forgetting"),
    ("forgetting_rate", "FR (DHA)"),
    ("fwt", "FWT"),
]


def safe_name(metric: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "", metric.replace("/", "-"))


# -- tables ------------------------------------------------------------------------------------
def table_final(
    m: dict[str, Any], label: str | None = None
) -> tuple[list[str], list[list[str]]] | None:
    fin = m.get("final") or {}
    if not any(fin.get(k) is not None for k in TABLE1):
        return None
    return ["Method", *TABLE1], [[label or m["method_label"], *(fmt(fin.get(k)) for k in TABLE1)]]


def table_so_far(m: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    sf = m.get("so_far_vs_final") or {}
    keys = [k for k in ("Rm", "mAP@1") if k in sf]
    if not keys:
        return None
    tasks = m["tasks"]
    headers = ["after task", "merged test set"]
    for k in keys:
        headers += [f"{k} so far", f"{k} final", "Δ"]
    rows = []
    for i in range(len(sf[keys[0]])):
        r = [f"{i} ({tasks[i]})", f"tasks 0..{i}"]
        for k in keys:
            e = sf[k][i]
            r += [fmt(e["so_far"]), fmt(e["final"]), fmt(e["delta"], signed=True)]
        rows.append(r)
    return headers, rows


def table_dha(m: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    cont = m.get("continual") or {}
    if "TR@mean" not in cont or "IR@mean" not in cont:
        return None
    n = len(cont["TR@mean"]["final_row"])
    tasks = m["tasks"][:n]
    headers = ["direction"]
    for t in tasks:
        headers += [f"{t} R@mean", f"{t} FR"]
    headers += ["avg R@mean", "avg FR"]
    rows = []
    for key, name in (("IR@mean", "T2I"), ("TR@mean", "I2T")):
        c = cont[key]
        r = [name]
        for j in range(n):
            fr = c["forgetting_rate_per_task"][j] if j < n - 1 else None
            r += [fmt(c["final_row"][j]), fmt(fr)]
        r += [fmt(c["average_final"]), fmt(c["forgetting_rate"])]
        rows.append(r)
    return headers, rows


def table_continual(m: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    cont = m.get("continual") or {}
    keys = [k for k in SUMMARY_METRICS if k in cont]
    if not keys:
        return None
    rows = [
        [k, *(fmt(cont[k][c], signed=c.startswith(("bwt", "fwt"))) for c, _ in CONTINUAL_COLS)]
        for k in keys
    ]
    return ["metric", *(h for _, h in CONTINUAL_COLS)], rows


def table_matrix(m: dict[str, Any], key: str) -> tuple[list[str], list[list[str]]] | None:
    mat = (m.get("matrices") or {}).get(key)
    if not mat:
        return None
    rows = []
    zs = m.get("zero_shot_row")
    if zs and key in zs:
        rows.append(["init (zero-shot)", *(fmt(v) for v in zs[key])])
    for label, row in zip(m["rows"], mat):
        rows.append([f"after {label}", *(fmt(v) for v in row)])
    return ["model \\ test", *m["tasks"]], rows


def table_map_variants(m: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    fin = m.get("final") or {}
    if fin.get("mAP@1") is None:
        return None
    rows = []
    for v, name in (
        ("", "eq. 11 (paper)"),
        ("/code", "CTP code"),
        ("/pos", "÷ min(N, #positives)"),
    ):
        rows.append([name, *(fmt(fin.get(f"mAP@{n}{v}")) for n in (1, 5, 10))])
    return ["AP normalisation", "mAP@1", "mAP@5", "mAP@10"], rows


def table_folders(m: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    f = m.get("folders") or {}
    if not f:
        return None
    rows = []
    for label, per in f.items():
        for folder, r in per.items():
            rows.append([label, folder, fmt(r.get("top1")), fmt(r.get("top5")), str(r.get("n"))])
    return ["checkpoint", "image folder", "top-1", "top-5", "images"], rows


def table_benchmarks(m: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    """Each checkpoint on each benchmark (eval sets of no task): TR@1 / IR@1 and Rm."""
    from cvl.evaluation.transfer import time_benchmarks

    skip = time_benchmarks(m)  # per-period retrieval sets: the TiC table shows them
    bs = {k: v for k, v in (m.get("benchmarks") or {}).items() if k not in skip}
    if not bs:
        return None
    labels: list[str] = []
    for b in bs.values():
        labels += [lab for lab in b["rows"] if lab not in labels]
    headers = ["checkpoint"]
    for name in bs:
        headers += [f"{name} TR@1 / IR@1", f"{name} Rm"]
    rows = []
    for lab in labels:
        row = [lab]
        for b in bs.values():
            i = b["rows"].index(lab) if lab in b["rows"] else None
            v = {k: (vals[i] if i is not None else None) for k, vals in b["metrics"].items()}
            row += [f"{fmt(v.get('TR@1'))} / {fmt(v.get('IR@1'))}", fmt(v.get("Rm"))]
        rows.append(row)
    return headers, rows


def sections(
    m: dict[str, Any], full: bool = True
) -> list[tuple[str, tuple[list[str], list[list[str]]] | None]]:
    from cvl.evaluation.transfer import table_tic

    n = len(m["rows"])
    out = [
        (
            f"Final model (after {n} task(s)) on the merged test set of the tasks it has seen (CTP Table 1)",
            table_final(m),
        ),
        (
            "So far vs final (CTP Fig. 4): model after task i, and the final model, on tasks 0..i",
            table_so_far(m),
        ),
        ("Per task, final model: R@mean and Forgetting Rate (DHA Table 1)", table_dha(m)),
        *mtil_sections(m),
        ("Continual summary (from the per-task R matrices)", table_continual(m)),
        ("Zero-shot classification on image folders", table_folders(m)),
        ("Benchmarks (eval sets of no task) after every checkpoint", table_benchmarks(m)),
        (
            "FoMo-in-Flux: knowledge accumulation (the tasks: ZS-top1 or R@5), zero-shot "
            "retention (held-out benchmarks and image folders) and their geometric mean",
            table_fomo(m),
        ),
        (
            "Dynamic retrieval (TiC-CLIP): mR@1 of each model on each period's retrieval set "
            "([ ] = the period it last trained on); in-distribution, backward and forward "
            "transfer",
            table_tic(m),
        ),
    ]
    if full:
        out.append(
            ("mAP@N of the final model under the three AP normalisations", table_map_variants(m))
        )
        extra = [k for k in MATRIX_METRICS_MTIL if m.get("mtil")]
        for k in MATRIX_METRICS + extra:
            out.append(
                (f"R matrix: {k} (rows: model; columns: test set of task j)", table_matrix(m, k))
            )
    return [(t, tb) for t, tb in out if tb is not None]


MTIL_NOTE = (
    "MTIL / X-TAIL (ZSCL's notebook): Transfer_j = mean_{i<j} R[i][j] (no Transfer for the "
    "first task; Transfer = mean over the others), Avg_j = mean_i R[i][j], Last_j = R[T][j]; "
    "rows = the task checkpoints (not the initial weights)"
)


def mtil_sections(m: dict[str, Any]) -> list:
    """MTIL / X-TAIL tables (`cvl.evaluation.mtil`) when the run has them."""
    from cvl.evaluation.mtil import sections as mtil_tables

    return mtil_tables(m)


def _runtime_lines(m: dict[str, Any]) -> list[str]:
    """Embedding precision, and where each checkpoint was evaluated (device, determinism)."""
    out = (
        [f"- embedding precision: {m['protocol']['precision']}"]
        if "precision" in m.get("protocol", {})
        else []
    )
    where = sorted(
        {
            f"{r['device']} ({r['processes']} process(es)), deterministic "
            + ("on" if r["deterministic"] else "off")
            for r in (m.get("runtime") or {}).values()
            if r
        }
    )
    if where:
        out.append(f"- evaluated on: {'; '.join(where)}")
    return out


def render_markdown(m: dict[str, Any], full: bool = True) -> str:
    lines = []
    if full:
        p = m["protocol"]
        lines += [
            f"# Evaluation of run `{m['run_name']}`",
            "",
            f"method **{m['method_label']}**, stream `{m['stream']['name']}` ({m['stream']['source']}), "
            f"{len(m['rows'])} task checkpoint(s){' + initial weights' if m.get('has_init') else ''}; "
            f"test set `{p['test_set']}`. Values in percent.",
            "",
            *([f"- **not the final model**: {m['unfinished']}"] if m.get("unfinished") else []),
            f"- retrieval: {p['retrieval_rule']}; ties {p['ties']}",
            "- Rm = mean of TR@1/5/10 and IR@1/5/10 (CTP); R@mean = mean of R@1/5/10 per direction (DHA)",
            f"- mAP feature: {p['map_feature']}",
            f"- {p['ap_normalisation']}",
            f"- zero-shot templates: `{p['zs_templates']}`; linear probe: {p['probe']}",
            *_runtime_lines(m),
            *([f"- {MTIL_NOTE}"] if m.get("mtil") else []),
            "- BWT (IncCLIP) = 1/(T-1) Σ_{i≥2} (1/i) Σ_{j≤i} (R[i][j] − R[j][j]); BWT = 1/(T-1) Σ_{j<T} "
            "(R[T][j] − R[j][j]); forgetting = mean_j max_{j≤l<T} R[l][j] − R[T][j]; "
            "FR_t = (R[t][t] − R[T][t]) / R[t][t]; FWT = 1/(T-1) Σ_{i≥2} (R[i-1][i] − zero-shot[i])",
            "",
        ]
    for title, (headers, rows) in sections(m, full):
        lines += [f"## {title}" if full else f"{title}", "", md_table(headers, rows), ""]
    return "\n".join(lines)


# -- CSV -----------------------------------------------------------------------------------
def _csv_bytes(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(headers)
    w.writerows([["" if v is None else v for v in r] for r in rows])
    return buf.getvalue().encode("utf-8")


def write_csvs(m: dict[str, Any], out: Path) -> list[Path]:
    files = []
    rows = []
    for k, mat in m["matrices"].items():
        if m.get("zero_shot_row"):
            rows += [[k, "init", t, v] for t, v in zip(m["tasks"], m["zero_shot_row"][k])]
        for label, row in zip(m["rows"], mat):
            rows += [[k, label, t, v] for t, v in zip(m["tasks"], row)]
    files.append(
        _write(out / "r_matrix.csv", _csv_bytes(["metric", "model", "test_task", "value"], rows))
    )
    rows = []
    for k, C in (m.get("cumulative") or {}).items():
        for label, row in zip(m["rows"], C):
            rows += [[k, label, f"0..{j}", v] for j, v in enumerate(row) if v is not None]
    files.append(
        _write(
            out / "cumulative.csv", _csv_bytes(["metric", "model", "merged_tasks", "value"], rows)
        )
    )
    cont = m.get("continual") or {}
    rows = [[k, *(cont[k][c] for c, _ in CONTINUAL_COLS)] for k in cont]
    files.append(
        _write(out / "continual.csv", _csv_bytes(["metric", *(c for c, _ in CONTINUAL_COLS)], rows))
    )
    from cvl.evaluation.transfer import table_tic

    for name, tb in (
        ("table_final.csv", table_final(m)),
        ("so_far_vs_final.csv", table_so_far(m)),
        ("per_task_final.csv", table_dha(m)),
        ("tic.csv", table_tic(m)),
    ):
        if tb is not None:
            files.append(_write(out / name, _csv_bytes(*tb)))
    return files


def _write(path: Path, data: bytes) -> Path:
    atomic_write_bytes(path, data)
    return path


# -- plots ---------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save_lines(fig: Any, ax: Any, path: Path) -> Path:
    """Legend, grid, layout, PNG at 100 dpi; closes the figure (the line plots' common end)."""
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def plot_heatmap(m: dict[str, Any], key: str, path: Path) -> Path | None:
    mat = m["matrices"][key]
    labels = list(m["rows"])
    if m.get("zero_shot_row"):
        mat = [m["zero_shot_row"][key], *mat]
        labels = ["init", *labels]
    return heatmap_png(mat, labels, m["tasks"], f"{m['run_name']}: {key}", "test set of task", path)


def heatmap_png(
    mat: Sequence[Sequence[float | None]],
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    xlabel: str,
    path: Path,
) -> Path | None:
    """A matrix (rows: models) as an annotated heatmap PNG; None when nothing was evaluated."""
    import numpy as np

    a = np.array([[np.nan if v is None else v for v in r] for r in mat], dtype=float)
    if np.isnan(a).all():
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(2.8 + 0.75 * a.shape[1], 1.8 + 0.5 * a.shape[0]))
    im = ax.imshow(a, cmap="viridis", vmin=0, vmax=max(1.0, float(np.nanmax(a))))
    ax.set_xticks(range(a.shape[1]), col_labels, rotation=45, ha="right")
    ax.set_yticks(range(a.shape[0]), row_labels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("model after")
    ax.set_title(title)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            if not np.isnan(a[i, j]):
                ax.text(
                    j,
                    i,
                    f"{a[i, j]:.1f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="w" if a[i, j] < 0.6 * np.nanmax(a) else "k",
                )
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curves(m: dict[str, Any], key: str, path: Path) -> Path | None:
    """Per-task curves across training steps (CTP Fig. 4 / DHA Fig. 4): R[i][j] against i."""
    mat = m["matrices"].get(key)
    if not mat or not any(v is not None for r in mat for v in r):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    zs = (m.get("zero_shot_row") or {}).get(key)
    rows = ([zs] if zs else []) + list(mat)
    x0 = -1 if zs else 0
    steps = list(range(x0, len(mat)))
    for j, t in enumerate(m["tasks"]):
        ys = [r[j] for r in rows]
        if any(y is not None for y in ys):
            ax.plot(
                steps,
                [float("nan") if y is None else y for y in ys],
                marker="o",
                ms=3,
                label=f"task {t}",
            )
    sf = (m.get("so_far_vs_final") or {}).get(key)
    if sf:
        ax.plot(
            list(range(len(sf))),
            [float("nan") if e["so_far"] is None else e["so_far"] for e in sf],
            "k--",
            lw=2,
            label="merged tasks 0..i",
        )
    names = ["init"] * (1 if zs else 0) + [
        f"{i} ({m['tasks'][i]})" if i < len(m["tasks"]) else str(i) for i in range(len(mat))
    ]
    ax.set_xticks(steps, names)
    ax.set_xlabel("model after task")
    ax.set_ylabel(key)
    ax.set_title(f"{m['run_name']}: {key} per task across training")
    return _save_lines(fig, ax, path)


def write_plots(m: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for k in m["matrices"]:
        if "/" in k:  # the alternative AP normalisations: in metrics.json and the CSV only
            continue
        p = plot_heatmap(m, k, out / f"heatmap_{safe_name(k)}.png")
        if p:
            files.append(p)
    for k in CURVE_METRICS:
        if k in m["matrices"]:
            p = plot_curves(m, k, out / f"curves_{safe_name(k)}.png")
            if p:
                files.append(p)
    tic = m.get("tic") or {}
    if tic.get("matrix"):  # TiC-CLIP's heatmap: each model on each period's retrieval set
        title = f"{m['run_name']}: {tic['metric']} on each period's retrieval set"
        p = heatmap_png(
            tic["matrix"], tic["rows"], tic["periods"], title, "period", out / "heatmap_tic.png"
        )
        if p:
            files.append(p)
    return files


def write_outputs(m: dict[str, Any], out: str | os.PathLike, plots: bool = True) -> list[Path]:
    """metrics.json, summary.md, CSV tables and PNG plots into `out`."""
    out = Path(out)
    write_json(out / "metrics.json", m)
    files = [out / "metrics.json", _write(out / "summary.md", render_markdown(m).encode("utf-8"))]
    files += write_csvs(m, out)
    if plots:
        files += write_plots(m, out / "plots")
    return files
