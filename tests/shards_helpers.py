"""The DataComp-format fixture (datasets/fixtures/datacomp/) and the two streams the issue asks
of it: a 5-task instance split and TiC's yearly stream, built in place."""

from __future__ import annotations

import shutil
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "datasets" / "fixtures" / "datacomp"
TIC = "tic/tic-datacomp_training_yearly_noeval"
EVALS = "tic/tic-datacomp_retrieval_evals_year2uids.json"


def fixture_copy(dest: Path) -> Path:
    """The fixture in a folder of the test's own (indexing writes beside the shards)."""
    shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns("*.py"))
    return dest


def instance_argv(shards: str, out: Path, *extra: str) -> list[str]:
    """(a) IncCLIP's instance split: 5 equal chunks, one test pair each."""
    return ["build-stream", "shards", "--shards", shards, "--chunks", "5", "--test", "1"] + [
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]


def tic_argv(shards: str, fixture: Path | str, out: Path, *extra: str) -> list[str]:
    """(b) TiC's yearly stream: DataComp's uids joined with TiC's uid files, 2014-2016 merged,
    the retrieval uids held out (`fixture`: the folder or URL of the TiC files)."""
    return [
        *("build-stream", "shards", "--shards", shards, "--id-col", "uid"),
        *("--join", f"{fixture}/{TIC}", "--time-col", "year"),
        *("--first-until", "2016", "--until", "2022", "--eval-ids", f"{fixture}/{EVALS}"),
        *("--out", str(out), "--quiet", *extra),
    ]
