"""Mean ± sd over seeds of MTIL's and X-TAIL's Transfer / Avg. / Last (a Markdown table).

Reads ROOT/s<seed>/SETTING/compare/compare.json (as `recipes/mtil_benchmark.sh` lays them
out: `recipes/mtil.sh --out ROOT/s<seed>` per seed) and prints one row per run, in the order
of the first seed's table, with the number of seeds it was found in.

    .venv/bin/python recipes/mtil_table.py ROOT [SETTING]        (SETTING: order1)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from seeds_table import cell  # noqa: E402

COLUMNS = [f"{p} {c}" for p in ("MTIL", "X-TAIL") for c in ("Transfer", "Avg.", "Last")]


def main(root: str, setting: str = "order1") -> None:
    files = sorted(Path(root).glob(f"s[0-9]*/{setting}/compare/compare.json"))
    if not files:
        sys.exit(f"no {root}/s*/{setting}/compare/compare.json")
    tables = [json.loads(f.read_text())["runs"] for f in files]
    runs = [r["run"] for r in tables[0]]
    print("| run | seeds | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for run in runs:
        rows = [r for t in tables for r in t if r["run"] == run]
        cells = [cell([r[c] for r in rows if r.get(c) is not None]) for c in COLUMNS]
        print(f"| {run} | {len(rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(*sys.argv[1:])
