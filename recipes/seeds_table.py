"""Mean ± sd over seeds of the headline numbers of evaluated runs (a Markdown table).

Reads ROOT/s<seed>/<run>/eval/metrics.json (as `recipes/synthetic_methods.sh` lays them out,
after `cvl eval`) or ROOT/s<seed>/runs/<run>/eval/metrics.json (`recipes/demo.sh`) and prints, per run name: the number of seeds, the average over tasks of the
final model's Rm and TR@1 (last row of the R matrix), forgetting (mean over tasks 0..T-2 of
max earlier R - final R), IncCLIP's BWT, the final model's Rm on the merged test set of all
tasks (CTP protocol) and its Rm on task 0. With `--cost`, also what each run cost to train
(run.json "cost", `cvl.train.cost`): total TFLOPs (training steps + extras) and optimizer steps.
With `--tic` (time-ordered streams, `recipes/tic.sh`): TiC-CLIP's in-distribution, backward and
forward transfer (metrics.json "tic", mR@1 on the per-period retrieval sets), the final model's
mR@1 averaged over all periods, then the cost columns.

With `--diagonal`, also the mean over tasks of R[t][t] (each task's Rm right after training on
it: the score of a routing that knows the task, e.g. `lora_per_task` with route=task).

    .venv/bin/python recipes/seeds_table.py ROOT seqft,joint,er,modx,... [--cost] [--tic] [--diagonal]
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


COST_COLUMNS = ("TFLOPs", "steps")
TIC_COLUMNS = ("ID", "backward", "forward", "final, all periods")


def tic(m: dict) -> dict[str, float | None]:
    """TiC-CLIP's summary of one metrics.json (None where the stream has no time layout)."""
    t = m.get("tic") or {}
    last = [v for v in (t.get("matrix") or [[]])[-1] if v is not None]
    return {
        "ID": t.get("id"),
        "backward": t.get("backward"),
        "forward": t.get("forward"),
        "final, all periods": statistics.mean(last) if last else None,
    }


DIAGONAL = "avg diagonal Rm"


def cost(run: Path) -> dict[str, float | None]:
    """Total TFLOPs and optimizer steps of the run folder `run` (None when not recorded)."""
    f = run / "run.json"
    c = json.loads(f.read_text()).get("cost") if f.is_file() else None
    if not c or not c.get("tasks"):
        return {"TFLOPs": None, "steps": None}
    steps = 0
    for t in sorted((run / "tasks").glob("*/task.json")):
        steps += json.loads(t.read_text()).get("steps", 0)
    return {"TFLOPs": c["total_flops"] / 1e12, "steps": float(steps)}


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
        DIAGONAL: statistics.mean(r[t] for t, r in enumerate(m["matrices"]["Rm"][-len(last_rm) :])),
    }


def cell(xs: list[float], digits: int = 1) -> str:
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def main(
    root: str, runs: str, with_cost: bool = False, with_tic: bool = False, diagonal: bool = False
) -> None:
    seeds = sorted(p for p in Path(root).glob("s[0-9]*") if p.is_dir())
    with_cost = with_cost or with_tic
    cols = (TIC_COLUMNS if with_tic else COLUMNS) + ((DIAGONAL,) if diagonal else ())
    cols += COST_COLUMNS if with_cost else ()
    summary = tic if with_tic else headline
    print("| run | seeds | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for run in runs.split(","):
        rows = [
            {**summary(json.loads(f.read_text())), **(cost(f.parent.parent) if with_cost else {})}
            for s in seeds
            for f in (s / run / "eval" / "metrics.json", s / "runs" / run / "eval" / "metrics.json")
            if f.is_file()
        ]
        if not rows:
            continue
        digits = {"TFLOPs": 3, "steps": 0}
        cells = [cell([r[c] for r in rows if r.get(c) is not None], digits.get(c, 1)) for c in cols]
        print(f"| {run} | {len(rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    flags = {"--cost", "--tic", "--diagonal"}
    args = [a for a in sys.argv[1:] if a not in flags]
    if len(args) != 2:
        sys.exit(__doc__)
    given = set(sys.argv[1:])
    main(args[0], args[1], "--cost" in given, "--tic" in given, "--diagonal" in given)
