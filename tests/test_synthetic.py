"""The built-in synthetic stream: determinism, domain separation, atomic output."""

from __future__ import annotations

import hashlib
import json

import pytest

from cvl.data.reader import PairDataset
from cvl.errors import CvlError
from cvl.streams.manifest import load_manifest
from cvl.streams.synthetic import SynthSpec, build_synthetic

SPEC = SynthSpec(
    tasks=2,
    per_task=20,
    test_per_task=5,
    val_per_task=0,
    query_per_task=3,
    gallery_per_task=5,
    overlap=0,
    seed=1,
)


def _digest(root) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.tar")):
        h.update(p.relative_to(root).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = build_synthetic(tmp_path / "a", SPEC, progress=False)
    build_synthetic(tmp_path / "b", SPEC, progress=False)
    build_synthetic(tmp_path / "c", SynthSpec(**{**SPEC.__dict__, "seed": 2}), progress=False)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")
    assert a.task_order == ["t0", "t1"] and set(a.eval_sets) == {"test", "query", "gallery"}


def test_domains_share_vocabulary_but_not_shapes(synth_stream):
    m = load_manifest(synth_stream)
    cats = [set(m.tasks[t].categories) for t in m.task_order]
    assert all(not (a & b) for i, a in enumerate(cats) for b in cats[i + 1 :])
    words = []
    for t in m.task_order:
        ds = PairDataset.from_shards(m.train_shards(t))
        items = [ds.read_raw(i) for i in range(len(ds))]
        assert {meta["category"] for _, _, meta in items} <= set(m.tasks[t].categories)
        assert all(meta["task"] == t for _, _, meta in items)
        words.append({w for _, cap, _ in items for w in cap.split()})
    shared = words[0] & words[1] & words[2]
    assert {"red", "small", "left", "background"} <= shared  # shared vocabulary
    assert words[0] - words[1]  # and task-specific words (shapes, style)


def test_refuses_existing_folder_and_bad_counts(tmp_path):
    build_synthetic(tmp_path / "s", SPEC, progress=False)
    with pytest.raises(CvlError, match="exists"):
        build_synthetic(tmp_path / "s", SPEC, progress=False)
    build_synthetic(tmp_path / "s", SPEC, overwrite=True, progress=False)
    with pytest.raises(CvlError, match="positive"):
        build_synthetic(tmp_path / "z", SynthSpec(tasks=0), progress=False)
    assert not (tmp_path / "z").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temp folders left behind


def test_overlap_chains_shapes_and_styles_between_neighbours():
    from cvl.streams.synthetic import task_domains

    doms = task_domains(SynthSpec(tasks=4, shapes_per_task=4, overlap=2, seed=3))
    for prev, cur in zip(doms, doms[1:]):
        assert cur["shapes"][:2] == prev["shapes"][-2:]  # kept from the previous task
        assert not set(cur["shapes"][2:]) & {
            s for d in doms[: doms.index(cur)] for s in d["shapes"]
        }
        assert cur["styles"] == [prev["style"], cur["style"]] and cur["style"] != prev["style"]
    assert not set(doms[0]["shapes"]) & set(doms[2]["shapes"])  # task 0's shapes leave
    assert doms[0]["styles"] == [doms[0]["style"]]
    disjoint = task_domains(SynthSpec(tasks=4, shapes_per_task=4, overlap=0, seed=3))
    assert all(d["styles"] == [d["style"]] for d in disjoint)
    assert len({s for d in disjoint for s in d["shapes"]}) == 16
    with pytest.raises(CvlError, match="overlap"):
        task_domains(SynthSpec(tasks=2, shapes_per_task=3, overlap=3))


def test_overlap_stream_draws_both_styles_and_pretrain_stream_covers_all(tmp_path):
    spec = SynthSpec(**{**SPEC.__dict__, "overlap": 1, "pretrain": 40, "shapes_per_task": 2})
    m = build_synthetic(tmp_path / "s", spec, progress=False)
    t1 = PairDataset.from_shards(m.train_shards("t1"))
    caps = [t1.read_raw(i)[1] for i in range(len(t1))]
    assert all(any(f" {st} " in c for st in m.tasks["t1"].extra["styles"]) for c in caps)
    assert {st for st in m.tasks["t1"].extra["styles"] if any(f" {st} " in c for c in caps)} == set(
        m.tasks["t1"].extra["styles"]
    )  # both styles occur
    assert m.source_args["pretrain_stream"] == "pretrain"
    pm = load_manifest(tmp_path / "s" / "pretrain")
    assert pm.task_order == ["pretrain"] and pm.tasks["pretrain"].train.count == 40
    assert set(pm.tasks["pretrain"].categories) == {
        c for t in m.task_order for c in m.tasks[t].categories
    }
    pre = PairDataset.from_shards(pm.train_shards("pretrain"))
    cats = {pre.read_raw(i)[2]["category"] for i in range(len(pre))}
    assert cats & set(m.tasks["t0"].categories) and cats - set(m.tasks["t0"].categories)
    assert pm.eval_sets["test"].tasks["pretrain"].count == 50


def test_overlap_styles_are_never_background_words():
    from cvl.streams.synthetic import BACKGROUNDS, task_domains

    doms = task_domains(SynthSpec(tasks=7, shapes_per_task=4, seed=0))  # default overlap: 3
    assert doms[1]["shapes"][:3] == doms[0]["shapes"][1:]
    assert not {s for d in doms for s in d["styles"]} & set(BACKGROUNDS)


def test_processes_write_the_same_bytes_as_one_process(tmp_path):
    """`--processes 3`: plans drawn in order, rendered elsewhere -> the same shard bytes
    (every style, the speckled one's random dots included, and the pretraining stream)."""
    from click.testing import CliRunner

    from cvl.streams.synthetic import synthetic_cmd, task_domains

    spec = SynthSpec(
        tasks=9,
        per_task=12,
        test_per_task=3,
        val_per_task=0,
        query_per_task=2,
        gallery_per_task=3,
        shapes_per_task=3,
        overlap=0,
        pretrain=10,
        seed=4,
    )
    one = build_synthetic(tmp_path / "one", spec, progress=False)
    many = build_synthetic(tmp_path / "many", spec, progress=False, processes=3)
    assert "speckled" in {d["style"] for d in task_domains(spec)}
    assert _digest(tmp_path / "one") == _digest(tmp_path / "many")
    assert one.tasks == many.tasks and one.source_args == many.source_args
    args = [
        "--out",
        str(tmp_path / "cli"),
        "--tasks",
        "9",
        "--per-task",
        "12",
        "--test-per-task",
        "3",
        "--val-per-task",
        "0",
        "--query-per-task",
        "2",
        "--gallery-per-task",
        "3",
        "--shapes-per-task",
        "3",
        "--overlap",
        "0",
        "--pretrain",
        "10",
        "--seed",
        "4",
        "--processes",
        "2",
        "--quiet",
    ]
    res = CliRunner().invoke(synthetic_cmd, args)
    assert res.exit_code == 0, res.output
    assert _digest(tmp_path / "cli") == _digest(tmp_path / "one")
    with pytest.raises(CvlError, match="processes"):
        build_synthetic(tmp_path / "z", spec, progress=False, processes=0)


# -- the time mode (a drifting, time-ordered stream: TiC-CLIP's protocol in CI) ---------------
def test_time_mode_periods_drift():
    """Concepts enter and leave (a moving window, the newest most frequent); colour and size
    words take newer names (half the captions the period before the switch, all after)."""
    from cvl.streams.synthetic_time import NEWER_WORDS, TimeSpec, period_domains

    doms = period_domains(TimeSpec(tasks=5, first_periods=3, shapes=4, overlap=2, seed=1))
    assert len(doms) == 7
    for prev, cur in zip(doms, doms[1:]):
        assert cur["shapes"][:2] == prev["shapes"][2:]  # two kept, two new
        assert cur["weights"] == sorted(cur["weights"]) and sum(cur["weights"]) == pytest.approx(1)
    assert not set(doms[0]["shapes"]) & set(doms[2]["shapes"])  # the first concepts left
    for w in NEWER_WORDS:
        probs = [d["words"][w][1] for d in doms]
        assert probs == sorted(probs) and probs[0] < 1.0 and probs[-1] == 1.0  # switched by the end
        assert set(probs) <= {0.0, 0.5, 1.0}


def test_time_mode_stream(tmp_path):
    """5 training tasks, the first 3 periods merged: 7 per-period retrieval benchmarks, the
    time layout, captions in the period's vocabulary; the same bytes with 2 processes."""
    from cvl.streams.synthetic_time import TimeSpec, build_synthetic_time

    spec = TimeSpec(tasks=5, first_periods=3, per_period=12, test_per_period=6, val_per_task=4)
    m = build_synthetic_time(tmp_path / "a", spec, progress=False)
    years = [str(y) for y in range(2014, 2021)]
    assert m.task_order == ["2014-2016", "2017", "2018", "2019", "2020"]
    assert m.time["periods"] == years and m.time["tasks"]["2014-2016"] == years[:3]
    assert {b: x.shards.count for b, x in m.benchmarks.items()} == {f"ret-{y}": 6 for y in years}
    assert (
        m.tasks["2014-2016"].train.count == 36
        and m.eval_sets["test"].tasks["2014-2016"].count == 18
    )
    assert m.eval_sets["val"].tasks["2017"].count == 4 and m.source == "synthetic"
    rep = json.loads((tmp_path / "a" / "build_report.json").read_text())
    assert rep["time"]["periods"]["2015"] == {"task": "2014-2016", "train": 12, "val": 0, "test": 6}
    late = PairDataset.from_shards(m.benchmark_shards("ret-2020"))
    items = [late.read_raw(i) for i in range(len(late))]
    assert all(meta["period"] == "2020" for *_, meta in items)
    new = {"crimson", "emerald", "azure", "golden", "violet", "amber", "ivory", "teal", "huge"}
    assert any(set(cap.split()) & new for _, cap, _ in items)
    b = build_synthetic_time(tmp_path / "b", spec, progress=False, processes=2)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") and b.task_order == m.task_order


def test_time_mode_cli(tmp_path, capsys):
    from cvl.cli import main

    out = tmp_path / "s"
    argv = ["build-stream", "synthetic", "--mode", "time", "--tasks", "3", "--per-task", "8"]
    assert main([*argv, "--test-per-task", "4", "--out", str(out), "--quiet"]) == 0
    assert load_manifest(out).task_order == ["2014", "2015", "2016"]
    assert main([*argv, "--pretrain", "10", "--out", str(tmp_path / "x")]) == 2
    assert "--pretrain: not in --mode time" in capsys.readouterr().err
    assert main([*argv[:2], "--first-periods", "2", "--out", str(tmp_path / "y")]) == 2
