"""How the reports write numbers and tables: `fmt` (percent with two decimals, "–" for
missing) and `md_table` (a Markdown table).

The lowest piece of the report modules: the benchmark tables (fomo.py, mtil.py, transfer.py)
and report.py, which lays those tables out, all format with it, so none imports report.py for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def fmt(v: Any, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if abs(v) < 0.005:
        v = 0.0  # no "-0.00"
    return f"{v:+.2f}" if signed else f"{v:.2f}"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (values already formatted as strings)."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)
