"""Mean ± sd over seeds of the headline numbers of evaluated runs (a Markdown table).

Reads ROOT/s<seed>/<run>/eval/metrics.json (as `recipes/synthetic_methods.sh` lays them out,
after `cvl eval`) or ROOT/s<seed>/runs/<run>/eval/metrics.json (`recipes/demo.sh`) and prints, per run name: the number of seeds, the average over tasks of the
final model's Rm and TR@1 (last row of the R matrix), forgetting (mean over tasks 0..T-2 of
max earlier R - final R), IncCLIP's BWT, the final model's Rm on the merged test set of all
tasks (CTP protocol) and its Rm on task 0.

    .venv/bin/python recipes/seeds_table.py ROOT seqft,joint,er,modx,...
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

COLUMNS = (
    "avg final Rm",
    "forgetting Rm",
    "BWT Rm (IncCLIP)",
    "avg final TR@1",
    "forgetting TR@1",
    "merged Rm",
    "task-0 Rm",
)


def headline(m: dict) -> dict[str, float | None]:
    """The table's numbers for one metrics.json (None where the run has no such value)."""
    cont = m.get("continual") or {}
    last_rm, last_tr = m["matrices"]["Rm"][-1], m["matrices"]["TR@1"][-1]
    return {
        "avg final Rm": statistics.mean(last_rm),
        "forgetting Rm": cont.get("Rm", {}).get("forgetting"),
        "BWT Rm (IncCLIP)": cont.get("Rm", {}).get("bwt_incclip"),
        "avg final TR@1": statistics.mean(last_tr),
        "forgetting TR@1": cont.get("TR@1", {}).get("forgetting"),
        "merged Rm": (m.get("final") or {}).get("Rm"),
        "task-0 Rm": last_rm[0],
    }


def cell(xs: list[float]) -> str:
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.1f}"
    return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}"


def main(root: str, runs: str) -> None:
    seeds = sorted(p for p in Path(root).glob("s[0-9]*") if p.is_dir())
    print("| run | seeds | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for run in runs.split(","):
        rows = [
            headline(json.loads(f.read_text()))
            for s in seeds
            for f in (s / run / "eval" / "metrics.json", s / "runs" / run / "eval" / "metrics.json")
            if f.is_file()
        ]
        if not rows:
            continue
        cells = [cell([r[c] for r in rows if r[c] is not None]) for c in COLUMNS]
        print(f"| {run} | {len(rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
