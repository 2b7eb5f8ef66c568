"""FoMo-in-Flux's knowledge accumulation, zero-shot retention and geometric mean
(cvl/evaluation/fomo.py) on a hand-made metrics.json: which numbers enter, per model."""

from __future__ import annotations

import math

import pytest

from cvl.evaluation.comparison import compare_records
from cvl.evaluation.fomo import compare_values, fomo_summary, table_fomo


def metrics() -> dict:
    """Two tasks: `a` has categories (a classification dataset: ZS-top1), `b` has none (a
    retrieval dataset: R@5 = (TR@5 + IR@5) / 2); one benchmark and one image folder held out."""
    return {
        "run_name": "r",
        "method_label": "seqft",
        "tasks": ["a", "b"],
        "rows": ["00-a", "01-b"],
        "matrices": {
            "ZS-top1": [[50.0, None], [40.0, None]],
            "TR@5": [[60.0, 20.0], [55.0, 70.0]],
            "IR@5": [[40.0, 10.0], [45.0, 50.0]],
            "Rm": [[1.0, 2.0], [3.0, 4.0]],
        },
        "zero_shot_row": {
            "ZS-top1": [30.0, None],
            "TR@5": [10.0, 20.0],
            "IR@5": [30.0, 40.0],
            "Rm": [0.0, 0.0],
        },
        "benchmarks": {
            "coco": {
                "rows": ["init", "00-a", "01-b"],
                "metrics": {"TR@5": [80.0, 70.0, 60.0], "IR@5": [60.0, 50.0, 40.0]},
            }
        },
        "folders": {
            "init": {"/imgs": {"top1": 50.0}},
            "00-a": {"/imgs": {"top1": 40.0}},
            "01-b": {"/imgs": {"top1": 30.0}},
        },
    }


def test_knowledge_accumulation_retention_and_geometric_mean():
    f = fomo_summary(metrics())
    assert f["rows"] == ["init", "00-a", "01-b"]
    assert f["adaptation"] == {"a": "ZS-top1", "b": "R@5"}
    assert f["held_out"] == ["coco", "/imgs"]
    # A_KA: mean over BOTH tasks at every model (task b not trained yet included):
    # init (30 + (20+40)/2) / 2 = 30; after a (50 + (20+10)/2) / 2 = 32.5;
    # after b (40 + (70+50)/2) / 2 = 50
    assert f["ka"] == pytest.approx([30.0, 32.5, 50.0])
    # A_ZS: coco's R@5 (70, 60, 50) and the folder's top-1 (50, 40, 30), averaged
    assert f["zs"] == pytest.approx([60.0, 50.0, 40.0])
    assert f["gm"] == pytest.approx([math.sqrt(1800), math.sqrt(1625), math.sqrt(2000)])
    assert f["init"] == pytest.approx({"ka": 30.0, "zs": 60.0, "gm": math.sqrt(1800)})
    assert f["final"] == pytest.approx({"ka": 50.0, "zs": 40.0, "gm": 44.72135955})


def test_missing_values_and_no_held_out_sets():
    m = metrics()
    m["matrices"]["IR@5"][0][1] = None  # one set of the model after task a not evaluated
    del m["benchmarks"], m["folders"]
    f = fomo_summary(m)
    assert f["ka"] == pytest.approx([30.0, None, 50.0])
    assert f["zs"] == [None, None, None] and f["gm"] == [None, None, None]
    assert f["held_out"] == []
    # no initial weights evaluated: the rows are the task checkpoints only
    m2 = metrics()
    del m2["zero_shot_row"]
    f2 = fomo_summary(m2)
    assert f2["rows"] == ["00-a", "01-b"] and f2["init"] is None
    assert f2["final"]["ka"] == pytest.approx(50.0)


def test_tables_and_comparison_columns():
    m = metrics()
    headers, rows = table_fomo(m)
    assert headers[1:] == ["knowledge accumulation", "zero-shot retention", "geometric mean"]
    assert rows[-1] == ["01-b", "50.00", "40.00", "44.72"]
    assert compare_values(m) == pytest.approx(
        {"A_KA": 50.0, "A_ZS": 40.0, "GM (FoMo)": 44.72135955}
    )
    headers, recs = compare_records([m])  # an older metrics.json without "fomo": recomputed
    assert {"A_KA", "A_ZS", "GM (FoMo)"} <= set(headers)
    assert recs[0]["A_KA"] == pytest.approx(50.0)
