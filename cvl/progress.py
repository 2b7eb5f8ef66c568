"""Progress bars: one helper for every bar cvl draws (training, evaluation, builds).

A bar is drawn only when standard error is a terminal. Written into a file, a pipe (`| tee`),
make's or a CI system's log, tqdm's carriage-return redraws become one line per update, so
there the bar stays off and the command's own lines (task saved, files written) say what
happened; `--quiet` turns bars off on a terminal too.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm


def interactive() -> bool:
    """True when standard error is a terminal (where a redrawn bar stays on one line)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


def progress_bar(iterable: Iterable | None = None, *, show: bool = True, **kw: Any) -> tqdm:
    """tqdm over `iterable` (or a manual bar with `total=`), drawn only when `show` and
    standard error is a terminal; tqdm's other keywords as given."""
    return tqdm(iterable, disable=not (show and interactive()), **kw)
