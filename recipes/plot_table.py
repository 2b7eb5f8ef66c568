#!/usr/bin/env python3
"""Bar chart of a results table in the docs (mean ± sd cells), for the README and the site.

The numbers are read from the Markdown table itself (the output of the command the page
names), never typed in here, so the figure changes when the table is rerun:

    python recipes/plot_table.py docs/results.md --after "The papers' regime" \\
        --columns "avg final Rm" "forgetting Rm" --out docs/img/headline.png
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

CELL = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(?:±\s*(\d+(?:\.\d+)?))?\s*$")


def first_table(text: str, after: str) -> list[list[str]]:
    """Rows (header first) of the first Markdown table after the line containing `after`."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if after in line), None)
    if start is None:
        raise SystemExit(f"error: no line containing {after!r}")
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        elif rows:
            break
    if len(rows) < 2:
        raise SystemExit(f"error: no table after {after!r}")
    return rows


def column(rows: list[list[str]], name: str) -> tuple[list[str], list[float], list[float]]:
    """Run names, means and sds of column `name`; a cell that is no number ("–") is NaN, so
    every column has the same rows."""
    if name not in rows[0]:
        raise SystemExit(f"error: no column {name!r} (columns: {', '.join(rows[0])})")
    j = rows[0].index(name)
    runs, means, sds = [], [], []
    for row in rows[1:]:
        m = CELL.match(row[j])
        runs.append(row[0])
        means.append(float(m.group(1)) if m else float("nan"))
        sds.append(float(m.group(2) or 0.0) if m else 0.0)
    return runs, means, sds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path)
    ap.add_argument("--after", required=True, help="text of a line above the table")
    ap.add_argument("--columns", nargs="+", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = first_table(a.page.read_text(), a.after)
    fig, axes = plt.subplots(1, len(a.columns), figsize=(4.2 * len(a.columns), 3.6), sharey=True)
    axes = [axes] if len(a.columns) == 1 else list(axes)
    for ax, name in zip(axes, a.columns):
        runs, means, sds = column(rows, name)
        y = list(range(len(runs)))[::-1]
        ax.barh(y, means, xerr=sds, color="#3f51b5", alpha=0.85, capsize=3)
        ax.set_yticks(y, runs)
        ax.axvline(0, color="black", linewidth=0.6)
        ax.set_xlabel(f"{name} (%)")
        ax.grid(axis="x", alpha=0.3)
    if a.title:
        fig.suptitle(a.title, fontsize=10)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
