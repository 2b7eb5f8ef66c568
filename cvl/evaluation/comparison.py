"""`cvl eval --compare`'s report: several runs side by side (final and continual scores, the
benchmarks, each run's training cost), its CSV, and the plots of Rm over the tasks seen and
of final Rm against compute."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cvl.evaluation.fomo import COMPARE_COLS as FOMO_COLS
from cvl.evaluation.fomo import compare_values as fomo_values
from cvl.evaluation.report import (
    TABLE1,
    _csv_bytes,
    _plt,
    _save_lines,
    _write,
    fmt,
    md_table,
    safe_name,
)
from cvl.evaluation.transfer import COMPARE_COLS as TIC_COLS
from cvl.evaluation.transfer import compare_values as tic_values
from cvl.evaluation.transfer import time_benchmarks
from cvl.io import write_json

COMPARE_CONTINUAL = [  # (column, metric, continual field, signed)
    ("avg Rm", "Rm", "average_final", False),
    ("BWT(Rm)", "Rm", "bwt_standard", True),
    ("BWT-IncCLIP(Rm)", "Rm", "bwt_incclip", True),
    ("forget(Rm)", "Rm", "forgetting", False),
    ("FR I2T", "TR@mean", "forgetting_rate", False),
    ("FR T2I", "IR@mean", "forgetting_rate", False),
    ("ZS-top1", "ZS-top1", "average_final", False),
    ("LP-top1", "LP-top1", "average_final", False),
]
BENCH_METRICS = ["TR@1", "IR@1", "Rm"]
# what each run cost to train (cvl.train.cost; run.json / task.json "cost"): (column, key, scale)
COST_COLS = [
    ("TFLOPs", "total_flops", 1e12),
    ("peak mem (GB)", "peak_memory_bytes", 1e9),
    ("device-hours", "device_hours", 1.0),
]


def run_cost(m: dict[str, Any]) -> dict[str, Any] | None:
    """The training cost of the run behind metrics `m` (totals over its finished tasks), or
    None when the run folder is gone or its tasks were trained before cost was recorded."""
    run = Path(str(m.get("run") or ""))
    if not (run / "run.json").is_file():
        return None
    from cvl.train.cost import summarize_run

    c = summarize_run(run)
    return c if c["tasks"] and not c["tasks_without_cost"] else None


def benchmark_names(ms: Sequence[dict[str, Any]]) -> list[str]:
    """The benchmarks (eval sets of no task) of the runs, in first-seen order; not the
    per-period retrieval sets of a time-ordered stream (summarised by the TiC columns)."""
    names: list[str] = []
    for m in ms:
        skip = time_benchmarks(m)
        names += [b for b in m.get("benchmarks") or {} if b not in names and b not in skip]
    return names


def _finite(v: Any) -> Any:
    """NaN / inf -> None (JSON has no NaN)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def compare_records(ms: Sequence[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """One record per run (column -> raw value, None when not measured): the final model on
    the merged test set (CTP Table 1), the continual summary of the per-task R matrices (avg,
    BWT, forgetting, DHA FR, zero-shot, probe), what the run cost to train (`COST_COLS`, from
    its task.json files) and the final checkpoint on every benchmark (Mod-X / DKR / IncCLIP:
    COCO 5K, Flickr30K 1K, ...)."""
    from cvl.evaluation.mtil import compare_columns

    bench = benchmark_names(ms)
    mt = compare_columns(ms)
    headers = ["run", "method", *(h for h, *_ in mt), *TABLE1, *(c for c, *_ in COMPARE_CONTINUAL)]
    headers += [c for c, _ in FOMO_COLS]  # FoMo-in-Flux's A_KA, A_ZS, GM (cvl.evaluation.fomo)
    headers += [c for c, *_ in COST_COLS]
    tic = any(m.get("tic") for m in ms)  # a time-ordered stream: TiC-CLIP's transfer columns
    headers += [c for c, _ in TIC_COLS] if tic else []
    headers += [f"{b} {k}" for b in bench for k in BENCH_METRICS]
    recs = []
    for m in ms:
        fin, cont = m.get("final") or {}, m.get("continual") or {}
        rec: dict[str, Any] = {"run": m["run_name"], "method": m["method_label"]}
        for h, key, field_ in mt:
            rec[h] = ((m.get("mtil") or {}).get(key) or {}).get(field_)
        rec.update({k: fin.get(k) for k in TABLE1})
        for col, metric, field_, _ in COMPARE_CONTINUAL:
            rec[col] = (cont.get(metric) or {}).get(field_)
        rec.update(fomo_values(m))
        for b in bench:
            bm = (m.get("benchmarks") or {}).get(b) or {}
            for k in BENCH_METRICS:
                vals = (bm.get("metrics") or {}).get(k) or [None]
                rec[f"{b} {k}"] = vals[-1]  # the last row: the final checkpoint
        cost = run_cost(m)
        for col, key, scale in COST_COLS:
            rec[col] = cost[key] / scale if cost else None
        if tic:
            rec.update(tic_values(m))
        recs.append(rec)
    return headers, recs


def compare_table(ms: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """`compare_records` formatted: one row of strings per run."""
    headers, recs = compare_records(ms)
    signed = {c for c, *_, s in COMPARE_CONTINUAL if s}
    costs = {c for c, *_ in COST_COLS}

    def cell(h: str, v: Any) -> str:
        if h in ("run", "method"):
            return v
        if h in costs:
            return "–" if v is None else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}")
        return fmt(v, h in signed)

    rows = [[cell(h, r[h]) for h in headers] for r in recs]
    return headers, rows


def render_compare(ms: Sequence[dict[str, Any]]) -> str:
    headers, rows = compare_table(ms)
    bench = benchmark_names(ms)
    more = (
        f"; the final checkpoint on each benchmark ({', '.join(bench)}: TR@1, IR@1, Rm)"
        if bench
        else ""
    )
    return (
        "Runs side by side: CTP Table-1 metrics of the final model on the merged test set of all "
        "tasks; avg/BWT/forgetting of Rm and DHA FR from the per-task R matrices"
        + more
        + (
            "; TiC-CLIP's in-distribution / backward / forward transfer (mR@1 = mean of TR@1 "
            "and IR@1 on the per-period retrieval sets, mean over the matrix entries of each kind)"
            if any(m.get("tic") for m in ms)
            else ""
        )
        + " (percent); what each run cost to train: total TFLOPs (training steps + extras such as "
        "Fisher passes and buffer selection, summed over processes), peak memory per process, "
        "device-hours (wall time × processes)\n\n" + md_table(headers, rows) + "\n"
    )


def seen_so_far(m: dict[str, Any], key: str) -> list[float | None]:
    """Per task k: mean of R[k][0..k] for the model after task k (the standard CL curve).

    Rows are placed by their checkpoint label (`NN-name`), so a joint run's single final
    model is a point at the last task; tasks without a checkpoint are None.
    """
    out: list[float | None] = [None] * len(m["tasks"])
    for label, row in zip(m["rows"], m["matrices"].get(key) or []):
        k = int(str(label).split("-", 1)[0])
        vals = [v for v in row[: k + 1] if v is not None]
        if k < len(out) and vals:
            out[k] = sum(vals) / len(vals)
    return out


def run_colors(ms: Sequence[dict[str, Any]]) -> list[str]:
    """One colour per run of a comparison, by its position among the runs: every plot of the
    comparison draws a run in its colour, also when a plot leaves some runs out (no cost
    recorded, no curve), where matplotlib's own colour cycle would shift the rest."""
    plt = _plt()
    cycle = [plt.get_cmap("tab10")(i) for i in range(10)]
    if len(ms) > 10:
        cycle = [plt.get_cmap("tab20")(i) for i in range(20)]
    from matplotlib.colors import to_hex

    return [to_hex(cycle[i % len(cycle)]) for i in range(len(ms))]


def plot_compare(
    ms: Sequence[dict[str, Any]], key: str, path: Path, colors: Sequence[str] | None = None
) -> Path | None:
    """One line per run: `key` averaged over the tasks seen so far, after each task."""
    curves = [(m["run_name"], seen_so_far(m, key)) for m in ms]
    if not any(v is not None for _, c in curves for v in c):
        return None
    colors = list(colors or run_colors(ms))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (name, c), color in zip(curves, colors):
        ys = [float("nan") if v is None else v for v in c]
        ax.plot(range(len(ys)), ys, marker="o", ms=3, label=name, color=color)
    tasks = ms[0]["tasks"]
    ax.set_xticks(range(len(tasks)), [f"{i} ({t})" for i, t in enumerate(tasks)])
    ax.set_xlabel("model after task")
    ax.set_ylabel(f"{key}, mean over tasks seen")
    ax.set_title(f"{key} on the tasks seen so far")
    return _save_lines(fig, ax, path)


def plot_compute(
    ms: Sequence[dict[str, Any]], path: Path, colors: Sequence[str] | None = None
) -> Path | None:
    """Final average Rm (over tasks, the last R-matrix row) against training compute: one
    point per run, labelled, in the run's colour (`run_colors`)."""
    colors = list(colors or run_colors(ms))
    pts = []
    for m, color in zip(ms, colors):
        cost = run_cost(m)
        avg = ((m.get("continual") or {}).get("Rm") or {}).get("average_final")
        if cost and avg is not None and cost["total_flops"] > 0:
            pts.append((m["run_name"], cost["total_flops"] / 1e12, avg, color))
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, x, y, color in pts:
        ax.scatter([x], [y], s=18, color=color)
        ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    xs = [x for _, x, _, _ in pts]
    if max(xs) / min(xs) > 20:
        ax.set_xscale("log")
    ax.set_xlabel("training compute (TFLOPs, steps + extras)")
    ax.set_ylabel("final average Rm (%)")
    ax.set_title("Final average Rm against compute")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_compare(
    ms: Sequence[dict[str, Any]], out: str | os.PathLike, plots: bool = True
) -> list[Path]:
    """compare.md, compare.csv, compare.json (raw values, null when not measured) and
    (plots) compare_Rm.png / compare_TR1.png and compare_Rm_vs_compute.png into `out`."""
    out = Path(out)
    headers, rows = compare_table(ms)
    files = [
        _write(out / "compare.md", render_compare(ms).encode("utf-8")),
        _write(out / "compare.csv", _csv_bytes(headers, rows)),
    ]
    recs = [{k: _finite(v) for k, v in r.items()} for r in compare_records(ms)[1]]
    write_json(out / "compare.json", {"columns": headers, "runs": recs})
    files.append(out / "compare.json")
    colors = run_colors(ms) if plots else []  # a run has one colour in every plot
    if plots and len({tuple(m["tasks"]) for m in ms}) == 1:  # curves share one task axis
        for key in ("Rm", "TR@1"):
            p = plot_compare(ms, key, out / f"compare_{safe_name(key)}.png", colors)
            if p:
                files.append(p)
    if plots and (p := plot_compute(ms, out / "compare_Rm_vs_compute.png", colors)):
        files.append(p)
    return files
