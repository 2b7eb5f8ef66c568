"""Progress bars: one helper for every bar cvl draws (training, evaluation, builds).

On a terminal (standard error) a bar is redrawn in place. Written into a file, a pipe
(`| tee`), make's or a CI system's log, tqdm's carriage-return redraws would become one line
per update, and no bar at all left long work (an evaluation of many checkpoints) silent for
minutes: there a bar prints plain lines instead, the first once it has run `LOG_EVERY_S`
seconds and then at most one per `LOG_EVERY_S` (work shorter than that prints nothing
beyond the command's own lines). `--quiet` turns bars off everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

LOG_EVERY_S = 30.0  # without a terminal: the most one bar prints (one line per this many s)


def interactive() -> bool:
    """True when standard error is a terminal (where a redrawn bar stays on one line)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


class _Lines:
    """What tqdm writes, as whole lines: its redraws ('\\r' + the bar) become one line each,
    its clearing writes (blank) nothing."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, s: str) -> None:
        text = s.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _LogBar(tqdm):
    """A bar without a terminal: a new postfix or description waits for the next line."""

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kw: Any) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kw)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        super().set_postfix_str(s, refresh=False)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        super().set_description(desc, refresh=False)

    def set_description_str(self, desc: str | None = None, refresh: bool = True) -> None:
        super().set_description_str(desc, refresh=False)


def progress_bar(iterable: Iterable | None = None, *, show: bool = True, **kw: Any) -> tqdm:
    """tqdm over `iterable` (or a manual bar with `total=`), when `show`: redrawn on a
    terminal, else a plain line at most every `LOG_EVERY_S` seconds (module doc); tqdm's
    other keywords as given."""
    if not show or interactive():
        return tqdm(iterable, disable=not show, **kw)
    kw.pop("dynamic_ncols", None)  # no terminal to measure
    logged = dict(mininterval=LOG_EVERY_S, delay=LOG_EVERY_S, ascii=True, ncols=80)
    return _LogBar(iterable, file=_Lines(sys.stderr), **{**kw, **logged})
