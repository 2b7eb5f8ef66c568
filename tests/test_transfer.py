"""TiC-CLIP's in-distribution / backward / forward transfer (cvl.evaluation.transfer) on
hand-made matrices, and end to end: a drifting synthetic stream trained, evaluated and
compared (metrics.json "tic", summary.md, compare columns)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from cvl.evaluation.transfer import mean_r1, relations, summary, tic_table

# 3 training steps over 5 periods; the first step merged periods 0-2 (TiC's 2014-2016)
M = [
    [10.0, 20.0, 30.0, 40.0, 50.0],
    [11.0, 21.0, 31.0, 41.0, 51.0],
    [12.0, 22.0, 32.0, 42.0, 52.0],
]
ROWS = [2, 3, 4]  # the last period each step trained on


def test_relations_follow_the_last_period_trained_on():
    assert relations(ROWS, 5)[0] == ["backward", "backward", "id", "forward", "forward"]
    assert relations(ROWS, 5)[2] == ["backward"] * 4 + ["id"]


def test_summary_pools_the_entries_of_each_kind():
    s = summary(M, ROWS)
    assert s["id"] == pytest.approx((30 + 41 + 52) / 3)
    # backward: 2 + 3 + 4 entries (10, 20 | 11, 21, 31 | 12, 22, 32, 42), pooled: 201 / 9
    assert s["backward"] == pytest.approx(201 / 9)  # not the mean of row means (21)
    assert s["forward"] == pytest.approx((40 + 50 + 51) / 3)
    assert [r["backward"] for r in s["per_row"]] == pytest.approx([15, 21, 27])
    assert s["per_row"][2]["forward"] is None


def test_missing_entries_are_left_out_and_a_single_row_has_no_forward():
    holes = [[None, 20.0, 30.0, float("nan"), 50.0]]
    s = summary(holes, [2])
    assert (s["backward"], s["id"], s["forward"]) == (20.0, 30.0, 50.0)
    final_only = summary([M[2]], [4])  # plain joint: the final Oracle
    assert final_only["forward"] is None and final_only["id"] == 52.0


def test_mean_r1_is_datacomps_mean_recall_at_1():
    assert mean_r1({"TR@1": 40.0, "IR@1": 60.0, "Rm": 99.0}) == 50.0
    assert mean_r1({"TR@1": 40.0}) is None and mean_r1(None) is None


def test_tic_table_from_benchmark_results():
    periods = ["2014", "2015", "2016", "2017"]
    man = SimpleNamespace(
        time={
            "periods": periods,
            "tasks": {"2014-2015": ["2014", "2015"], "2016": ["2016"], "2017": ["2017"]},
            "eval": {p: f"ret-{p}" for p in periods},
        }
    )

    def res(base):
        return {
            "benchmarks": {
                f"ret-{p}": {"TR@1": base + j, "IR@1": base + j + 2} for j, p in enumerate(periods)
            }
        }

    results = {"init": res(0), "00-2014-2015": res(10), "01-2016": res(20), "02-2017": res(30)}
    rows = [("init", None), ("00-2014-2015", "2014-2015"), ("01-2016", "2016"), ("02-2017", "2017")]
    t = tic_table(man, rows, results)
    assert t["rows"] == ["00-2014-2015", "01-2016", "02-2017"]
    assert t["row_periods"] == ["2015", "2016", "2017"]
    assert t["zero_shot_row"] == [1.0, 2.0, 3.0, 4.0]
    assert t["matrix"][0] == [11.0, 12.0, 13.0, 14.0]
    assert t["id"] == pytest.approx((12 + 23 + 34) / 3)
    assert t["backward"] == pytest.approx((11 + 21 + 22 + 31 + 32 + 33) / 6)
    assert t["forward"] == pytest.approx((13 + 14 + 24) / 3)
    assert tic_table(SimpleNamespace(time=None), rows, results) is None


@pytest.mark.slow
def test_time_ordered_run_end_to_end(tmp_path):
    """Drifting synthetic stream (3 tasks, the first merging 2 periods) -> seqft and the
    Oracle -> cvl eval --compare: metrics.json's tic matrix is every checkpoint on every
    period's set, summary.md has the TiC table, compare.csv the TiC columns and not the nine
    period benchmarks one by one."""
    from reliability_helpers import cli

    from cvl.streams.synthetic_time import TimeSpec, build_synthetic_time

    s = tmp_path / "s"
    build_synthetic_time(
        s, TimeSpec(tasks=3, first_periods=2, per_period=16, test_per_period=8), progress=False
    )
    common = ["train", "--stream", str(s), "--epochs", "1", "--batch-size", "8", "--quiet"]
    common += ["--log-with", "none", "--max-steps-per-task", "2", "--workers", "0"]
    cli([*common, "--out", str(tmp_path / "seq")])
    oracle = [
        "--method",
        "joint",
        "--method-arg",
        "cumulative=true",
        "--method-arg",
        "restart=true",
    ]
    cli([*common, *oracle, "--out", str(tmp_path / "oracle")])
    cli(
        [
            "eval",
            "--compare",
            str(tmp_path / "seq"),
            str(tmp_path / "oracle"),
            "--out",
            str(tmp_path / "cmp"),
        ]
        + ["--no-probe", "--no-zeroshot", "--quiet"]
    )
    m = json.loads((tmp_path / "seq" / "eval" / "metrics.json").read_text())
    tic = m["tic"]
    assert tic["periods"] == ["2014", "2015", "2016", "2017"]
    assert tic["rows"] == ["00-2014-2015", "01-2016", "02-2017"]
    assert tic["row_periods"] == ["2015", "2016", "2017"]
    assert len(tic["matrix"]) == 3 and all(len(r) == 4 for r in tic["matrix"])
    b = m["benchmarks"]["ret-2016"]["metrics"]
    i = m["benchmarks"]["ret-2016"]["rows"].index("01-2016")
    assert tic["matrix"][1][2] == pytest.approx((b["TR@1"][i] + b["IR@1"][i]) / 2)
    assert all(0 <= tic[k] <= 100 for k in ("id", "backward", "forward"))
    md = (tmp_path / "seq" / "eval" / "summary.md").read_text()
    assert "Dynamic retrieval (TiC-CLIP)" in md and "ret-2014 TR@1" not in md
    cmp = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert "ID (TiC)" in cmp["columns"] and not any(c.startswith("ret-") for c in cmp["columns"])
    assert all(not math.isnan(r["backward (TiC)"]) for r in cmp["runs"])
    cli(["eval", "--run", str(tmp_path / "seq"), "--no-probe", "--no-zeroshot", "--quiet"])
    assert (tmp_path / "seq" / "eval" / "plots" / "heatmap_tic.png").is_file()  # from the cache
