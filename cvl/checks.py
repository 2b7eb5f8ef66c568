"""One home for checking the numbers and switches a user gives cvl.

A `Num` is a rule for one number (integer or float, bounds, values allowed outside them such
as -1 = auto) and is at once a click parameter type: every numeric option of every command is
declared with one (`tests/test_reliability_settings.py` walks the commands and fails on an
option without it). The same rules check what does not come through click: the fields of a
resolved `cvl train` config (a `--config` YAML included), `--method-arg` and `--tune-arg`
values. NaN and infinities are refused everywhere (a NaN passes every `x < 0` test, so a
rule that only compares would let it through), a float is not silently truncated into an
integer option, and a switch is a real boolean (`to_bool`): "maybe" is an error, not False.
"""

from __future__ import annotations

import math
from typing import Any

import click

from cvl.errors import CvlError

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


class Num(click.ParamType):
    """An integer or a finite float within bounds (a click type and a plain checker).

    `lo` / `hi`: inclusive bounds unless `lo_open` / `hi_open`; `special`: values accepted
    outside them, with what they mean (`{-1: "auto"}`).
    """

    def __init__(
        self,
        kind: type = float,
        lo: float | None = None,
        hi: float | None = None,
        *,
        lo_open: bool = False,
        hi_open: bool = False,
        special: dict[float, str] | None = None,
    ) -> None:
        self.kind = kind
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        self.special = dict(special or {})
        self.name = "integer" if kind is int else "float"

    def describe(self) -> str:
        """What the rule accepts, in words: "an integer >= 1", "a finite number in [0, 1)"."""
        what = "an integer" if self.kind is int else "a finite number"
        if self.lo is not None and self.hi is not None:
            rng = (
                f" in {'(' if self.lo_open else '['}{_fmt(self.lo)}, "
                f"{_fmt(self.hi)}{')' if self.hi_open else ']'}"
            )
        elif self.lo is not None:
            rng = f" {'>' if self.lo_open else '>='} {_fmt(self.lo)}"
        elif self.hi is not None:
            rng = f" {'<' if self.hi_open else '<='} {_fmt(self.hi)}"
        else:
            rng = ""
        extra = "".join(f", or {_fmt(k)} ({v})" for k, v in self.special.items())
        return what + rng + extra

    def problem(self, value: Any) -> tuple[Any, str | None]:
        """(the value as this rule's kind, None) or (value, why it is refused)."""
        if isinstance(value, bool) or value is None:
            return value, self.describe()
        try:
            if self.kind is int:
                f = float(value) if not isinstance(value, int) else value
                if isinstance(f, float) and not (math.isfinite(f) and f.is_integer()):
                    return value, self.describe()
                v: Any = int(f)
            else:
                v = float(value)
        except (TypeError, ValueError, OverflowError):
            return value, self.describe()
        if v in self.special:
            return v, None
        if not math.isfinite(v):
            return value, self.describe()
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return value, self.describe()
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return value, self.describe()
        return v, None

    def check(self, value: Any, name: str) -> Any:
        """`value` as this rule's kind, or a one-line CvlError naming `name`."""
        v, why = self.problem(value)
        if why is not None:
            raise CvlError(f"{name} must be {why}, got {value!r}")
        return v

    # -- click -------------------------------------------------------------------------------
    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        v, why = self.problem(value)
        if why is not None:
            self.fail(f"must be {why}, got {value}", param, ctx)
        return v

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "INTEGER" if self.kind is int else "FLOAT"

    def __repr__(self) -> str:
        return f"Num({self.describe()})"


POSITIVE_INT = Num(int, 1)
NON_NEGATIVE_INT = Num(int, 0)
SEED = Num(int, 0)  # numpy's generators refuse negative seeds
POSITIVE_FLOAT = Num(float, 0, lo_open=True)
NON_NEGATIVE_FLOAT = Num(float, 0)
FINITE = Num(float)
WORKERS = Num(int, 0, special={-1: "auto"})


def to_bool(value: Any, name: str) -> bool:
    """A real boolean from a bool, 0/1 or a YAML-ish word (true/false, yes/no, on/off);
    anything else is a one-line error (a typo must not quietly mean False)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise CvlError(f"{name} must be true or false, got {value!r}")


def check_scalar(value: Any, like: Any, name: str) -> Any:
    """`value` coerced to the type of the default `like` with the checks above: a strict
    boolean, a finite number (an integer where `like` is one); other types are converted as
    `type(like)(value)`. Used for `--method-arg` values."""
    if isinstance(like, bool):
        return to_bool(value, name)
    if isinstance(like, (int, float)):
        return Num(type(like)).check(value, name)
    if isinstance(value, float) and not math.isfinite(value):
        raise CvlError(f"{name} must be finite, got {value!r}")
    if like is None or isinstance(value, type(like)):
        return value
    try:
        return type(like)(value)
    except (TypeError, ValueError):
        raise CvlError(f"{name}={value!r} is not a {type(like).__name__}") from None
