"""Time-ordered streams (TiC-CLIP, Garg et al. ICLR 2024): one task per period of a timestamp.

`cvl build-stream table --time-col COL` reads each pair's date and puts it in a period: a
calendar `year`, `quarter` (``2014-Q1``) or `month` (``2014-03``), or the intervals between
explicit cut points (``--cuts 2017-01-01,2019-07-01``: ``until-2017-01-01``, ``2017-01-01``,
``2019-07-01``). Periods are training tasks in time order; ``--first-until P`` merges every
period up to P into the first task (TiC-DataComp's first step is 2014–2016, then one step per
year to 2022: 7 training steps). From every period ``--test N`` pairs are held out (seeded) as
its *dynamic retrieval* set, or the pairs an ``--eval-ids`` file names (TiC's released
``tic-datacomp_retrieval_evals_year2uids.json``); TiC evaluates every step's model on every
period's set (9 yearly sets for 7 steps), so the stream carries them as benchmarks
``ret-PERIOD``, and each task's ``test`` set is the union of its periods' sets (a merged first
task writes one sub-folder per period: ``eval/test/2014-2016/2015/...``). A merged task is
named by what it spans: ``2014-2016``, ``2014-01-2016-12``; between cut points
``until-2019-07-01`` (every interval before that cut).

Dates are never guessed: a missing date is dropped as ``missing_date``, an unreadable one as
``bad_date``, dates outside ``--since`` / ``--until`` as ``before_since`` / ``after_until``
(a bound counts from the start of what ``--since`` names to the end of what ``--until`` and
``--first-until`` name: ``--until 2022`` keeps December 2022 under ``--period month``);
build_report.json counts them and every period's pairs (``time``). Readable dates (`--time-format`,
default ``auto``): date/datetime values (parquet), ISO 8601 strings (``2014-03-05``,
``2014-03-05T12:00:00Z``, ``2014/03/05``, ``2014-03``), numbers (a JSON or parquet value and
the text of a CSV cell alike: ``2014``, ``2014.0`` and ``"2014.0"`` are one value) whose integral
value has 4 (``2014``: a year), 6 (``201403``: TiC's month names) or 8 digits (``20140305``),
any other number (negative, fractional, other lengths) as Unix seconds (YFCC's
``dateuploaded``); ``epoch``, ``epoch_ms``, ``iso`` or a strptime
pattern (``%d.%m.%Y``) read one way only. Times with a zone are converted to UTC, naive ones
are taken as UTC.

The manifest's optional ``time`` field records the layout (`cvl eval` derives TiC's
in-distribution / backward / forward transfer from it, `cvl.evaluation.transfer`)::

    "time": {"unit": "year", "column": "timestamp",
             "periods": ["2014", ..., "2022"],                  # time order
             "tasks": {"2014-2016": ["2014", "2015", "2016"], "2017": ["2017"], ...},
             "eval": {"2014": "ret-2014", ...}}                  # period -> benchmark
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from cvl.errors import CvlError
from cvl.streams.manifest import Benchmark, ShardSet
from cvl.streams.rows import Dropper, Row
from cvl.streams.splitcore import SPLITS, Assigned, time_split
from cvl.streams.splitrules import SplitRule
from cvl.streams.tablefiles import load_json
from cvl.streams.timeparse import parse_time  # noqa: F401 (re-exported)

UNITS = ("year", "quarter", "month")
DROPS = ("missing_date", "bad_date", "before_since", "after_until")  # why a date is not used
FORMATS = ("auto", "iso", "epoch", "epoch_ms")
BENCH_PREFIX = "ret-"


def factorize(values: list[Any]) -> tuple[list[Any], np.ndarray]:
    """The distinct values (first appearance order; 2014 and "2014" stay apart: each is parsed
    by its own rule) and each item's index among them: dates are parsed once per value."""
    at: dict[Any, int] = {}
    uniq: list[Any] = []
    inv = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        try:
            k: Any = (type(v), v)
            hash(k)
        except TypeError:  # a list or object from JSON: unreadable, one entry per text
            k = (type(v), repr(v))
        j = at.get(k)
        if j is None:
            j = at[k] = len(uniq)
            uniq.append(v)
        inv[i] = j
    return uniq, inv


# -- periods ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Periods:
    """How dates become periods: calendar `unit`s, or the intervals between `cuts`."""

    unit: str = "year"
    cuts: tuple[_dt.datetime, ...] = ()

    @classmethod
    def make(cls, unit: str, cuts: str | None) -> Periods:
        if cuts:
            pts = [_cut(c) for c in cuts.split(",") if c.strip()]
            if not pts or any(b <= a for a, b in zip(pts, pts[1:])):
                raise CvlError(f"--cuts {cuts!r}: give increasing dates (2017-01-01,2019-07-01)")
            return cls("cuts", tuple(pts))
        if unit not in UNITS:
            raise CvlError(f"--period must be one of {', '.join(UNITS)}, got {unit!r}")
        return cls(unit)

    def key(self, dt: _dt.datetime) -> tuple[int, ...]:
        """A sortable key of the period holding `dt`."""
        if self.unit == "cuts":
            return (int(np.searchsorted(np.array(self.cuts, dtype=object), dt, side="right")),)
        if self.unit == "year":
            return (dt.year,)
        if self.unit == "quarter":
            return (dt.year, (dt.month - 1) // 3 + 1)
        return (dt.year, dt.month)

    def label(self, key: tuple[int, ...]) -> str:
        if self.unit == "cuts":
            i = key[0]
            return f"until-{_day(self.cuts[0])}" if i == 0 else _day(self.cuts[i - 1])
        if self.unit == "year":
            return str(key[0])
        if self.unit == "quarter":
            return f"{key[0]}-Q{key[1]}"
        return f"{key[0]}-{key[1]:02d}"

    def key_of_label(self, text: str, what: str, end: bool = False) -> tuple[int, ...]:
        """The period key of a period given on the command line (`--first-until 2016`): the
        period holding its start, or with `end` (an upper bound: --first-until, --until) its
        end, so that a year given with --period month means its December."""
        try:
            span = _span(text.strip())
        except ValueError:
            span = None
        if span is None:
            raise CvlError(f"{what} {text!r}: not a date or period (e.g. 2016, 2016-06, 2016-Q2)")
        return self.key(span[1] if end else span[0])

    def span_label(self, first: tuple[int, ...], last: tuple[int, ...]) -> str:
        """The name of the task merging the periods `first` .. `last` (in time order): what
        it spans (``2014-2016``; between cut points ``until-2019-07-01``)."""
        if first == last:
            return self.label(first)
        if self.unit != "cuts":
            return f"{self.label(first)}-{self.label(last)}"
        a, j = first[0], last[0]
        hi = _day(self.cuts[j]) if j < len(self.cuts) else None
        if a == 0:
            return f"until-{hi}" if hi else "all"
        lo = _day(self.cuts[a - 1])
        return f"{lo}-until-{hi}" if hi else f"from-{lo}"

    def describe(self) -> str:
        if self.unit == "cuts":
            return "intervals between the cut points " + ", ".join(_day(c) for c in self.cuts)
        return f"calendar {self.unit}s"


def _span(text: str) -> tuple[_dt.datetime, _dt.datetime] | None:
    """The first and last instant of a period or date given as text: a year (``2016``), a
    quarter (``2016-Q2``), a month (``2016-06``, ``201606``), a day, or an instant (its own
    span); None when empty. ValueError when it is not a date."""
    m = re.fullmatch(r"(\d{4})-[Qq]([1-4])", text)
    if m:
        y, q = int(m.group(1)), int(m.group(2))
        return _dt.datetime(y, 3 * q - 2, 1), _month_end(y, 3 * q)
    start = parse_time(text)
    if start is None:
        return None
    if re.fullmatch(r"\d{4}", text):
        return start, _month_end(start.year, 12)
    if re.fullmatch(r"\d{4}[-/]\d{1,2}|\d{6}", text):
        return start, _month_end(start.year, start.month)
    if re.fullmatch(r"\d{4}[-/]\d{1,2}[-/]\d{1,2}|\d{8}", text):
        return start, start + _dt.timedelta(days=1, microseconds=-1)
    return start, start


def _month_end(year: int, month: int) -> _dt.datetime:
    """The last instant of a month."""
    nxt = _dt.datetime(year + month // 12, month % 12 + 1, 1)
    return nxt - _dt.timedelta(microseconds=1)


def _day(d: _dt.datetime) -> str:
    return d.strftime("%Y-%m-%d")


def _cut(text: str) -> _dt.datetime:
    try:
        dt = parse_time(text.strip())
    except ValueError:
        dt = None
    if dt is None:
        raise CvlError(f"--cuts: {text!r} is not a date (2017-01-01, 2017-06, 2017)")
    return dt


def load_eval_ids(path: str) -> set[str]:
    """Ids of the held-out retrieval pairs: a JSON list, or an object of lists (TiC's
    ``{year: [uid, ...]}``: the keys are only informative, each pair's period is its date)."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise CvlError(f"--eval-ids: {p}: file not found")
    d = load_json(p)
    lists = d.values() if isinstance(d, dict) else [d]
    out: set[str] = set()
    for v in lists:
        if not isinstance(v, list):
            raise CvlError(f"--eval-ids {p}: expected a list of ids or an object of lists")
        out.update(str(x) for x in v)
    return out


# -- the split rule -----------------------------------------------------------------------------
class TimeSplit(SplitRule):
    """One task per period (the first ``first_until`` periods merged), per-period held-out
    retrieval sets (module docstring). The raw date of a row is ``row.meta[column]``."""

    name = "time"

    def __init__(
        self,
        column: str,
        periods: Periods,
        *,
        fmt: str = "auto",
        first_until: str | None = None,
        since: str | None = None,
        until: str | None = None,
        test: int = 0,
        val: int = 0,
        limit: int | None = None,
        eval_ids: set[str] | None = None,
        seed: int = 0,
    ) -> None:
        if fmt not in FORMATS and "%" not in fmt:
            raise CvlError(
                f"--time-format must be {', '.join(FORMATS)} or a strptime pattern, got {fmt!r}"
            )
        if eval_ids is not None and test:
            raise CvlError("--eval-ids gives the retrieval pairs: drop --test")
        self.column, self.p, self.fmt = column, periods, fmt
        key = periods.key_of_label
        self.first = key(first_until, "--first-until", end=True) if first_until else None
        self.since = key(since, "--since") if since else None
        self.until = key(until, "--until", end=True) if until else None
        self.test, self.val, self.limit, self.eval_ids, self.seed = (
            test,
            val,
            limit,
            eval_ids,
            seed,
        )
        self.first_until = first_until
        self.task_periods: dict[str, list[str]] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.unsampled = 0
        self.warnings: list[str] = []  # the build report's (a period without its retrieval set)

    # -- assign ---------------------------------------------------------------------------------
    def assign(self, rows: list[Row], drop: Dropper) -> list[Row]:
        values, inverse = factorize([r.meta.get(self.column) for r in rows])
        period, keys, details = self.periods_of(values)
        period = period[inverse]
        for i in np.flatnonzero(period < 0):
            drop(DROPS[-1 - period[i]], rows[i], detail=details[inverse[i]])
        dated = np.flatnonzero(period >= 0)
        for i in dated:
            rows[i].meta["period"] = self.p.label(keys[period[i]])
        held = None
        if self.eval_ids is not None:
            self.note_eval_ids({rows[i].id for i in dated} & self.eval_ids)
            held = np.array([r.id in self.eval_ids for r in rows], dtype=bool)
        if not len(dated):
            return []
        a = self.split_periods(period, keys, held)
        names = self.task_names()
        self.drawn = {*self.drawn, *(id(rows[i]) for i in np.flatnonzero(a.drawn))}
        keep = np.flatnonzero(a.task >= 0)
        for i in keep:
            rows[i].task, rows[i].split = names[a.task[i]], SPLITS[a.split[i]]
        return [rows[i] for i in keep]

    def periods_of(self, values: list[Any]) -> tuple[np.ndarray, list[tuple[int, ...]], list[str]]:
        """Per distinct date value: the index of its period among the periods found (sorted,
        returned second), or -1 - i for the drop reason ``DROPS[i]`` (missing or unreadable
        date, before --since, after --until), and the reason's detail."""
        code = np.full(len(values), -1, dtype=np.int64)
        found: list[tuple[int, ...] | None] = []
        details = []
        for j, raw in enumerate(values):
            k, why, detail = None, None, ""
            try:
                dt = parse_time(raw, self.fmt)
            except ValueError:
                why, detail = "bad_date", f"{self.column}={str(raw)[:80]!r}"
            else:
                if dt is None:
                    why, detail = "missing_date", f"no {self.column}"
                else:
                    k = self.p.key(dt)
                    if self.since is not None and k < self.since:
                        why, detail = "before_since", self.p.label(k)
                    elif self.until is not None and k > self.until:
                        why, detail = "after_until", self.p.label(k)
            found.append(None if why else k)
            details.append(detail)
            if why:
                code[j] = -1 - DROPS.index(why)
        keys = sorted({k for k in found if k is not None})
        at = {k: i for i, k in enumerate(keys)}
        for j, k in enumerate(found):
            if k is not None:
                code[j] = at[k]
        return code, keys, details

    def note_eval_ids(self, found: set[str]) -> None:
        """Warn when ids of --eval-ids match no dated pair in range (`found`: those that do)."""
        assert self.eval_ids is not None
        if len(found) < len(self.eval_ids):
            eg = ", ".join(sorted(self.eval_ids - found)[:3])
            self.warnings.append(
                f"--eval-ids: {len(self.eval_ids) - len(found)} of {len(self.eval_ids)} ids "
                f"match no dated pair in range (e.g. {eg})"
            )

    def split_periods(
        self, period: np.ndarray, keys: list[tuple[int, ...]], held: np.ndarray | None
    ) -> Assigned:
        """Tasks and held-out sets of items whose period is an index into `keys` (sorted;
        negative: dropped); `held`: the items of --eval-ids. Task indices follow
        `task_names()`; fills the per-period counts."""
        if self.first is not None and not any(k <= self.first for k in keys):
            raise CvlError(
                f"--first-until {self.first_until}: no dated pair up to it (the first period "
                f"is {self.p.label(keys[0])})"
            )
        head = max(1, sum(k <= self.first for k in keys)) if self.first is not None else 1
        a, counts = time_split(
            period,
            len(keys),
            head,
            held,
            test=self.test,
            val=self.val,
            limit=self.limit,
            seed=self.seed,
        )
        self.unsampled += a.unsampled
        for group in [keys[:head]] + [[k] for k in keys[head:]]:
            task = self.p.span_label(group[0], group[-1])
            self.task_periods[task] = [self.p.label(k) for k in group]
            for k in group:
                self.counts[self.p.label(k)] = {"task": task, **counts[keys.index(k)]}
        return a

    def task_names(self) -> list[str]:
        return list(self.task_periods)

    def shard_group(self, row: Row) -> str | None:
        """A task of several periods writes each period's pairs in a sub-folder."""
        return row.meta.get("period") if len(self.task_periods[row.task or ""]) > 1 else None

    def describe(self) -> str:
        parts = [f"one task per period of '{self.column}' ({self.p.describe()})"]
        if self.first is not None:
            parts.append(f"periods up to {self.p.label(self.first)} merged into the first task")
        held = "the pairs of --eval-ids" if self.eval_ids is not None else f"{self.test} pairs"
        parts.append(f"{held} per period held out as its dynamic retrieval set (ret-PERIOD)")
        if self.val:
            parts.append(f"{self.val} val pairs per task")
        if self.limit is not None:
            parts.append(f"at most {self.limit} training pairs per task (seeded)")
        return "; ".join(parts)

    def summary(self) -> dict[str, Any]:
        return {"periods_selected": self.counts, "unsampled": self.unsampled}

    # -- the manifest's time layout --------------------------------------------------------------
    def manifest_extra(
        self, sets: dict[tuple[str, str, str | None], ShardSet], tasks: list[str]
    ) -> dict[str, Any]:
        """Benchmarks ``ret-PERIOD`` (each period's written test pairs) and the `time` field.
        `sets`: the written sets by (split, task, period), period None for a whole set."""
        layout = {t: self.task_periods[t] for t in tasks}
        tests = {}
        for t, ps in layout.items():
            for p in ps:
                ss = sets.get(("test", t, p)) or (
                    sets.get(("test", t, None)) if len(ps) == 1 else None
                )
                if ss is not None and ss.count:
                    tests[p] = ss
        if self.test or self.eval_ids is not None:  # retrieval sets asked for: say which lack one
            for t, ps in self.task_periods.items():
                for p in ps:
                    if p in tests:
                        continue
                    n = self.counts.get(p, {}).get("test", 0)
                    why = (
                        f"its task '{t}' was left out (no training pair)"
                        if t not in layout
                        else f"none of its {n} held-out pairs was written (see dropped.jsonl)"
                        if n
                        else "no pair of it is in --eval-ids"
                        if self.eval_ids is not None
                        else "too few pairs to hold any out"
                    )
                    self.warnings.append(f"period {p} has no retrieval set (ret-{p}): {why}")
        return time_layout(layout, tests, unit=self.p.unit, column=self.column)


def time_layout(
    task_periods: dict[str, list[str]],
    test_sets: dict[str, ShardSet],
    *,
    unit: str,
    column: str | None,
) -> dict[str, Any]:
    """The manifest extras of a time-ordered stream: a benchmark per period with a test set,
    and the `time` field (also used by the synthetic builder's time mode)."""
    periods = [p for ps in task_periods.values() for p in ps]
    bench = {
        f"{BENCH_PREFIX}{p}": Benchmark(
            "pairs", test_sets[p], f"dynamic retrieval set of period {p} (TiC-CLIP)"
        )
        for p in periods
        if p in test_sets and test_sets[p].count
    }
    time = {
        "unit": unit,
        **({"column": column} if column else {}),
        "periods": periods,
        "tasks": task_periods,
        "eval": {p: f"{BENCH_PREFIX}{p}" for p in periods if f"{BENCH_PREFIX}{p}" in bench},
    }
    return {"benchmarks": bench, "time": time}


# -- command line (`cvl build-stream table`) ------------------------------------------------------
_KEYS = ("time_col", "unit", "cuts", "first_until", "since", "until", "fmt_time", "eval_ids")


def time_options(f):  # noqa: ANN001, ANN202
    """The --time-col options of `cvl build-stream table`."""
    opts = [
        click.option(
            "--time-col",
            default=None,
            help="Column with each pair's date: one task per period, in time order (TiC-CLIP's "
            "time-ordered streams; see the options below and datasets/tic-datacomp.md). "
            "--test N then holds out N pairs per period as its dynamic retrieval set.",
        ),
        click.option(
            "--period",
            "unit",
            default="year",
            show_default=True,
            type=click.Choice(["year", "quarter", "month"]),
            help="With --time-col: the period of a task.",
        ),
        click.option(
            "--cuts",
            default=None,
            metavar="DATE,DATE,...",
            help="With --time-col: periods are the intervals between these dates instead "
            "(until-D1, D1, D2, ...; dates as 2017-01-01, 2017-06 or 2017).",
        ),
        click.option(
            "--first-until",
            default=None,
            metavar="PERIOD",
            help="With --time-col: merge every period up to PERIOD (included) into the first task "
            "(TiC-DataComp: --first-until 2016 = one first step on 2014-2016). An upper bound means "
            "the end of what it names: a year with --period month or quarter is its December / Q4.",
        ),
        click.option(
            "--since",
            default=None,
            metavar="PERIOD",
            help="With --time-col: drop pairs before PERIOD (from its start: a year with --period "
            "month is its January).",
        ),
        click.option(
            "--until",
            default=None,
            metavar="PERIOD",
            help="With --time-col: drop pairs after PERIOD (to its end: --until 2022 keeps all of "
            "2022, also with --period month).",
        ),
        click.option(
            "--time-format",
            "fmt_time",
            default="auto",
            show_default=True,
            help="How --time-col is read: auto (datetimes, ISO 8601, 4/6/8-digit years/YYYYMM/YYYYMMDD, "
            "other numbers as Unix seconds), iso, epoch, epoch_ms, or a strptime pattern (%d.%m.%Y). "
            "Missing or unreadable dates are dropped and counted, never guessed.",
        ),
        click.option(
            "--eval-ids",
            type=click.Path(dir_okay=False),
            default=None,
            help="With --time-col: JSON list (or {period: [ids]}) of the --id-col values held out as "
            "the periods' retrieval sets instead of --test random pairs (TiC-DataComp's "
            "tic-datacomp_retrieval_evals_year2uids.json).",
        ),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def time_spec(kw: dict[str, Any]) -> dict[str, Any] | None:
    """Pop the --time-col options from a command's kwargs: `build_table`'s `time`, or None
    (an error when a time option is given without --time-col)."""
    v = {k: kw.pop(k) for k in _KEYS}
    if not v["time_col"]:
        given = [f"--{k.replace('_', '-')}" for k in _KEYS[2:6] if v[k]]
        given += ["--eval-ids"] if v["eval_ids"] else []
        if given:
            raise CvlError(f"{', '.join(given)}: only with --time-col")
        return None
    return {
        "column": v["time_col"],
        "unit": v["unit"],
        "cuts": v["cuts"],
        "first_until": v["first_until"],
        "since": v["since"],
        "until": v["until"],
        "fmt": v["fmt_time"],
        "eval_ids": v["eval_ids"],
    }
