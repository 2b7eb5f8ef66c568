"""Dates from table cells and JSON values (`parse_time`): the formats `--time-format` names
(`auto`: a year / YYYYMM / YYYYMMDD number, epoch seconds, or ISO 8601; `iso`; `epoch`;
`epoch_ms`; a strptime pattern), as naive UTC datetimes."""

from __future__ import annotations

import datetime as _dt
import re
from typing import Any

import numpy as np

_UTC = _dt.timezone.utc


def _digits(s: str) -> _dt.datetime | None:
    """4 digits: a year; 6: YYYYMM; 8: YYYYMMDD; None for other lengths."""
    try:
        if len(s) == 4:
            return _dt.datetime(int(s), 1, 1)
        if len(s) == 6:
            return _dt.datetime(int(s[:4]), int(s[4:]), 1)
        if len(s) == 8:
            return _dt.datetime(int(s[:4]), int(s[4:6]), int(s[6:]))
    except ValueError:
        raise ValueError(f"not a date: {s!r}") from None
    return None


def _iso(s: str) -> _dt.datetime:
    s = s.strip().replace("/", "-")
    if re.fullmatch(r"\d{4}-\d{1,2}", s):  # year-month
        y, m = s.split("-")
        return _dt.datetime(int(y), int(m), 1)
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    return _dt.datetime.fromisoformat(s)


def _epoch(x: float, scale: float = 1.0) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(float(x) / scale, tz=_UTC)


def parse_time(value: Any, fmt: str = "auto") -> _dt.datetime | None:
    """A naive UTC datetime from a cell, None when it is missing (empty); ValueError when it
    cannot be read (module docstring for the rules of each `fmt`)."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    if isinstance(value, str) and not value.strip():
        return None
    if isinstance(value, bool):
        raise ValueError(f"not a date: {value!r}")
    try:
        dt = _parse(value, fmt)
    except (ValueError, OverflowError, OSError, TypeError) as e:
        raise ValueError(f"not a date: {value!r} ({e})") from None
    if dt.tzinfo is not None:
        dt = dt.astimezone(_UTC).replace(tzinfo=None)
    return dt


def _parse(value: Any, fmt: str) -> _dt.datetime:
    if isinstance(value, _dt.datetime):
        return value
    if isinstance(value, _dt.date):
        return _dt.datetime(value.year, value.month, value.day)
    if fmt in ("epoch", "epoch_ms"):
        return _epoch(float(value), 1000.0 if fmt == "epoch_ms" else 1.0)
    s = str(value).strip()
    if fmt == "iso":
        return _iso(s)
    if fmt != "auto":  # a strptime pattern
        return _dt.datetime.strptime(s, fmt)
    if isinstance(value, (int, float, np.integer, np.floating)) or _NUMBER.fullmatch(s):
        # a number, whether a JSON / parquet value or a CSV cell's text (2019, "2019.0", "-5")
        x = int(s) if re.fullmatch(r"\d+", s) else float(s)
        if float(x).is_integer() and x >= 0:
            d = _digits(str(int(x)))
            if d is not None:
                return d
        return _epoch(x)
    return _iso(s)


# a decimal number as text: digits with an optional sign, fraction and exponent
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
