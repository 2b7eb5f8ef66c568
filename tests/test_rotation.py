"""The Mod-X rotation analysis (SAM, RAM, ImAV): analytic rotations, bin edges, chunking, CLI."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
import torch

from cvl.analysis import rotation as rot
from cvl.errors import CvlError


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _orthogonal(d: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


def _isoclinic(d: int, deg: float, seed: int = 0) -> torch.Tensor:
    """An orthogonal matrix rotating *every* vector by exactly `deg` degrees (d even).

    Block-diagonal 2x2 rotations by the same angle (so <x, Qx> = cos(deg) |x|^2 for all x),
    conjugated by a random orthogonal matrix to hide the blocks.
    """
    t = math.radians(deg)
    q = torch.zeros(d, d, dtype=torch.float64)
    for k in range(0, d, 2):
        q[k : k + 2, k : k + 2] = torch.tensor(
            [[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]], dtype=torch.float64
        )
    u = _orthogonal(d, seed)
    return u @ q @ u.T


def _feats(n: int, d: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return _unit(torch.randn(n, d, generator=g, dtype=torch.float64)).to(dtype)


# -- bins ------------------------------------------------------------------------------------
def test_bin_labels_match_papers():
    assert rot.bin_labels(rot.SAM_EDGES) == [
        "[0°, 5°]",
        "(5°, 10°]",
        "(10°, 15°]",
        "(15°, 20°]",
        "(20°, 180°]",
    ]
    assert rot.bin_labels(rot.RAM_EDGES)[0] == "[0°, 15°]"
    assert rot.bin_labels(rot.RAM_EDGES)[-1] == "(30°, 180°]"


def test_exact_bin_edges_are_right_closed():
    v = torch.tensor(
        [0.0, 5.0, 5.000001, 10.0, 10.5, 15.0, 20.0, 20.000001, 180.0], dtype=torch.float64
    )
    assert rot.histogram(v, rot.SAM_EDGES).tolist() == [2, 2, 2, 1, 2]
    v = torch.tensor(
        [0.0, 15.0, 15.000001, 20.0, 25.0, 30.0, 30.000001, 179.0], dtype=torch.float64
    )
    assert rot.histogram(v, rot.RAM_EDGES).tolist() == [2, 2, 1, 1, 2]


def test_exact_edges_through_the_angle_math():
    # Rotation by exactly 15 deg (float64 features): every sample lands in [0, 15], none in (15, 20].
    x = _feats(50, 8, 1, torch.float64)
    y = x @ _isoclinic(8, 15.0).T
    ang = rot.paired_angles(x, y)
    assert torch.allclose(ang, torch.full_like(ang, 15.0), rtol=0, atol=1e-9)
    assert rot.histogram(ang, rot.RAM_EDGES).tolist() == [50, 0, 0, 0, 0]
    # A pair whose included angle changes by exactly 5 deg: 90 -> 85.
    c = math.radians(85.0)
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0.0], [math.cos(c), math.sin(c)]], dtype=torch.float64)
    counts, sums = rot.sam_counts([a, b], [(0, 1)])
    assert counts.tolist() == [[1, 0, 0, 0, 0]]
    assert sums.item() == pytest.approx(5.0, abs=1e-9)
    b2 = torch.tensor([[1.0, 0.0], [math.cos(c - 1e-6), math.sin(c - 1e-6)]], dtype=torch.float64)
    assert rot.sam_counts([a, b2], [(0, 1)])[0].tolist() == [[0, 1, 0, 0, 0]]


def test_cosines_are_clamped():
    x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    cos = torch.tensor([1.0 + 1e-7, -1.0 - 1e-7], dtype=torch.float64)
    out = rot.cos_to_deg(cos)
    assert out.tolist() == [0.0, 180.0]
    assert rot.paired_angles(x, x).item() == 0.0


# -- analytic rotations ----------------------------------------------------------------------
@pytest.mark.parametrize("deg, ram_bin", [(10.0, 0), (17.0, 1), (22.0, 2), (27.0, 3), (45.0, 4)])
def test_rigid_rotation_ram_is_the_angle_and_sam_is_unchanged(deg, ram_bin):
    x = _feats(40, 16, 2)
    y = (x.double() @ _isoclinic(16, deg, seed=3).T).float()
    ang = rot.paired_angles(x, y)
    assert torch.allclose(ang, torch.full_like(ang, deg), atol=1e-3)
    tables = rot.analyze_features(["0", "1"], vision=[x, y], modalities=("vision",))
    sam, ram = tables
    assert (sam.key, ram.key) == ("sam_vision", "ram_vision")
    assert sam.rows[0].percent == [100.0, 0.0, 0.0, 0.0, 0.0]
    assert sam.rows[0].n == 40 * 39 // 2
    assert sam.rows[0].mean < 1e-3
    expected = [0.0] * 5
    expected[ram_bin] = 100.0
    assert ram.rows[0].percent == expected
    assert ram.rows[0].mean == pytest.approx(deg, abs=1e-3)


def test_imav_of_known_intermodal_rotation():
    n, d = 30, 8
    img = _feats(n, d, 4)
    # Checkpoint a: text == image (angle 0, every sample retrieved correctly).
    # Checkpoint b: images unchanged, texts rotated by 12 deg -> image-text angle changes by 12.
    txt_b = (img.double() @ _isoclinic(d, 12.0, seed=5).T).float()
    # Checkpoint c: both rotated together by 40 deg -> image-text angle stays 12 (change 0).
    q = _isoclinic(d, 40.0, seed=6)
    img_c, txt_c = (img.double() @ q.T).float(), (txt_b.double() @ q.T).float()
    tables = rot.analyze_features(
        ["0", "1", "2"], vision=[img, img, img_c], text=[img, txt_b, txt_c]
    )
    imav = tables[-1]
    assert imav.key == "imav_image-text"
    rows = {r.label: r for r in imav.rows}
    assert list(rows) == ["ImAV_{(0,1)}", "ImAV_{(1,2)}", "ImAV_{(0,2)}"]
    assert rows["ImAV_{(0,1)}"].counts == [
        0,
        0,
        n,
        0,
        0,
    ]  # all n correct under 0; 12 deg in (10, 15]
    assert rows["ImAV_{(0,1)}"].mean == pytest.approx(12.0, abs=1e-3)
    assert rows["ImAV_{(0,2)}"].counts == [0, 0, n, 0, 0]
    r12 = rows["ImAV_{(1,2)}"]  # only the samples checkpoint 1 still retrieves correctly count
    correct1 = rot.retrieval_correct(img, txt_b)
    assert r12.n == int(correct1.sum()) and r12.counts[0] == r12.n
    # The vision RAM of (1,2) is the joint rotation, the text RAM too.
    ram_v = next(t for t in tables if t.key == "ram_vision")
    assert [r.label for r in ram_v.rows] == ["RAM_{(0,1)}", "RAM_{(1,2)}", "RAM_{(0,2)}"]
    assert ram_v.rows[0].percent[0] == 100.0 and ram_v.rows[1].percent[4] == 100.0


def test_retrieval_correct_and_duplicate_captions():
    img = torch.eye(4)
    txt = torch.eye(4)[[0, 1, 3, 2]]  # samples 2 and 3 retrieve each other's caption
    assert rot.retrieval_correct(img, txt).tolist() == [True, True, False, False]
    caps = ["a", "b", "c", "c"]  # ... but the captions are identical: both count as correct
    assert rot.retrieval_correct(img, txt, caps).tolist() == [True, True, True, True]
    assert rot.retrieval_correct(img, txt, ["a", "b", "c", "d"], chunk_rows=3).tolist() == [
        True,
        True,
        False,
        False,
    ]


# -- chunking and totals ---------------------------------------------------------------------
def test_chunked_equals_unchunked_and_dense():
    n, d = 37, 4
    x0 = _feats(n, d, 7)
    g = torch.Generator().manual_seed(8)
    x1 = _unit(x0 + 0.3 * torch.randn(n, d, generator=g))
    x2 = _unit(x1 + 0.6 * torch.randn(n, d, generator=g))
    feats, pairs = [x0, x1, x2], rot.checkpoint_pairs(3)
    dense = rot.sam_counts_dense(feats, pairs)
    big, sums_big = rot.sam_counts(feats, pairs, chunk_elems=1 << 20)
    for chunk in (1, 50, 500):
        small, sums_small = rot.sam_counts(feats, pairs, chunk_elems=chunk)
        assert torch.equal(small, big)
        assert torch.allclose(sums_small, sums_big)
    assert torch.equal(big, dense)
    assert (big.sum(1) == n * (n - 1) // 2).all()
    assert (big > 0).sum() >= 8  # the test data spreads over the bins
    # mean = the dense mean of |SAM_0 - SAM_1| over the upper triangle
    iu = torch.triu_indices(n, n, 1)
    unit64 = [_unit(f.double()) for f in (x0, x1)]
    ang = [torch.rad2deg(torch.arccos((u @ u.T).clamp(-1, 1)))[iu[0], iu[1]] for u in unit64]
    assert sums_big[0].item() == pytest.approx((ang[0] - ang[1]).abs().sum().item(), rel=1e-9)


def test_percentages_sum_to_100():
    for counts in ([1, 1, 1, 0, 0], [1, 2, 3, 4, 5], [7, 0, 0, 0, 0], [333, 333, 334, 1, 2]):
        p = rot.round_percentages(counts)
        assert round(sum(p), 6) == 100.0
        assert all(abs(a - 100 * c / sum(counts)) < 0.01 + 1e-9 for a, c in zip(p, counts))
    assert all(math.isnan(x) for x in rot.round_percentages([0, 0]))


def test_checkpoint_pairs():
    assert rot.checkpoint_pairs(2) == [(0, 1)]
    assert rot.checkpoint_pairs(4) == [(0, 1), (1, 2), (2, 3), (0, 3)]
    with pytest.raises(CvlError):
        rot.checkpoint_pairs(1)


def _random_result(seed=0, labels=("init", "0", "1")):
    g = torch.Generator().manual_seed(seed)
    base = _feats(25, 6, seed)
    vis = [_unit(base + s * torch.randn(25, 6, generator=g)) for s in (0.0, 0.3, 0.6)][
        : len(labels)
    ]
    txt = [_unit(v + 0.2 * torch.randn(25, 6, generator=g)) for v in vis]
    tables = rot.analyze_features(list(labels), vision=vis, text=txt)
    meta = {
        "run": f"runs/r{seed}",
        "eval": {"stream": "s", "split": "test", "task": "t0", "n_samples": 25},
    }
    cks = [{"label": lab, "description": f"ck {lab}"} for lab in labels]
    return rot.RotationResult(cks, tables, meta)


def test_markdown_csv_json_layout(tmp_path):
    res = _random_result()
    md = rot.result_markdown(res)
    assert [t.key for t in res.tables] == [
        "sam_vision",
        "sam_text",
        "ram_vision",
        "ram_text",
        "imav_image-text",
    ]
    rows = [
        ln
        for ln in md.splitlines()
        if ln.startswith("| SAM_{") or ln.startswith("| RAM_{") or ln.startswith("| ImAV_{")
    ]
    assert len(rows) == 5 * 3
    assert "| SAM_{init-0} |" in md and "| SAM_{init-1} |" in md and "| RAM_{(0,1)} |" in md
    for ln in rows:
        pct = [float(x) for x in re.findall(r"([\d.]+)%", ln)]
        assert len(pct) in (0, 5)
        if pct:
            assert sum(pct) == pytest.approx(100.0, abs=1e-9)
    files = rot.write_result(res, tmp_path / "a")
    names = {p.name for p in files}
    assert {
        "rotation.json",
        "rotation.md",
        "rotation_sam_vision.csv",
        "rotation_ram_text.csv",
    } <= names
    assert {"rotation_sam.png", "rotation_ram.png", "rotation_imav.png"} <= names
    for p in files:
        assert p.stat().st_size > 0
    d = json.loads((tmp_path / "a" / "rotation.json").read_text())
    assert d["schema"] == rot.SCHEMA and "sam" in d["definitions"]
    sam = d["tables"][0]
    assert sam["bins"][0] == "[0°, 5°]" and sam["rows"][0]["n"] == 25 * 24 // 2
    assert sum(sam["rows"][0]["percent"]) == pytest.approx(100.0)
    with open(tmp_path / "a" / "rotation_ram_vision.csv") as f:
        recs = list(csv.DictReader(f))
    assert [r["row"] for r in recs] == ["RAM_{(init,0)}", "RAM_{(0,1)}", "RAM_{(init,1)}"]
    for r in recs:
        assert sum(float(r[b]) for b in rot.bin_labels(rot.RAM_EDGES)) == pytest.approx(
            100.0, abs=1e-9
        )
        assert int(r["n"]) == 25


def test_compare_side_by_side(tmp_path):
    a, b = _random_result(0), _random_result(1, labels=("0", "1"))
    md = rot.compare_markdown(a, b, "seqft", "modx")
    assert "A = `seqft` vs B = `modx`" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| SAM_{0-1} |"))
    assert line.count(" / ") == 6  # five bins + n, each "A / B"
    assert "| SAM_{init-0} |" in md and "% / — |" in md  # only in run A
    files = rot.plot_compare(a, b, "seqft", "modx", tmp_path)
    assert {p.name for p in files} >= {"compare_sam_vision.png", "compare_ram_text.png"}


def test_bad_inputs():
    x = _feats(5, 4, 0)
    with pytest.raises(CvlError, match="shape"):
        rot.sam_counts([x, x[:4]], [(0, 1)])
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(CvlError, match="NaN"):
        rot.analyze_features(["0", "1"], vision=[x, bad])
    with pytest.raises(CvlError, match="two checkpoints"):
        rot.analyze_features(["0"], vision=[x])


def test_run_checkpoint_selection(tmp_path):
    run = tmp_path / "run"
    for d in ("init", "tasks/00-t0", "tasks/01-t1", "tasks/02-t2"):
        (run / d).mkdir(parents=True)
        (run / d / "model.safetensors").write_bytes(b"x")
    (run / "tasks" / "03-t3").mkdir()  # unfinished: no model file
    assert [c.label for c in rot.run_checkpoints(run)] == ["init", "0", "1", "2"]
    assert [c.label for c in rot.run_checkpoints(run, "t2,0")] == ["0", "2"]
    assert [c.label for c in rot.run_checkpoints(run, "init, 01-t1")] == ["init", "1"]
    with pytest.raises(CvlError, match="no checkpoint '3'"):
        rot.run_checkpoints(run, "0,3")
    with pytest.raises(CvlError, match="twice"):
        rot.run_checkpoints(run, "0,t0")
    with pytest.raises(CvlError, match="at least two"):
        rot.run_checkpoints(run, "1")
    # a random initialisation is left out of 'all' (still selectable by name)
    (run / "run.json").write_text(json.dumps({"config": {"pretrained": None}}))
    assert [c.label for c in rot.run_checkpoints(run)] == ["0", "1", "2"]
    assert [c.label for c in rot.run_checkpoints(run, "init,0")] == ["init", "0"]
    (run / "run.json").write_text(json.dumps({"config": {"pretrained": "/w/rn50.pt"}}))
    assert [c.label for c in rot.run_checkpoints(run)] == ["init", "0", "1", "2"]


# -- CLI end to end --------------------------------------------------------------------------
def _fake_run(root, stream, name, seed, with_init=False):
    """A 2-task run folder with random (different) weights per checkpoint."""
    from cvl.io import write_json
    from cvl.models import build_model, save_weights

    run = root / name
    model = None
    folders = (["init"] if with_init else []) + ["tasks/00-t0", "tasks/01-t1"]
    for k, folder in enumerate(folders):
        torch.manual_seed(100 * seed + k)
        model = build_model("clip", "tiny")
        save_weights(model, run / folder / "model.safetensors")
    write_json(
        run / "run.json",
        {
            "schema": "cvl.run/1",
            "config": {"method": name, "seed": seed},
            "model": model.config(),
            "stream": {"path": str(stream), "name": "synth", "task_order": ["t0", "t1", "t2"]},
        },
    )
    return run


@pytest.fixture(scope="module")
def two_runs(synth_stream, tmp_path_factory):
    models = pytest.importorskip("cvl.models")
    if not hasattr(models, "build_model"):
        pytest.skip("cvl.models.build_model is not available yet")
    root = tmp_path_factory.mktemp("runs")
    return _fake_run(root, synth_stream, "seqft", 0, with_init=True), _fake_run(
        root, synth_stream, "modx", 1
    )


def test_cli_rotation_end_to_end(two_runs, capsys):
    from cvl.cli import main

    run, _ = two_runs
    assert main(["analyze", "rotation", "--run", str(run), "--quiet", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "SAM_{" not in out  # --quiet: only the paths
    assert main(["analyze", "rotation", "--run", str(run)]) == 0
    out = capsys.readouterr().out
    for title in ("(vision)", "(text)", "(image-text)"):
        assert title in out
    for row in (
        "| SAM_{init-0} |",
        "| SAM_{0-1} |",
        "| SAM_{init-1} |",
        "| RAM_{(0,1)} |",
        "| ImAV_{(init,0)} |",
    ):
        assert row in out
    an = run / "analysis"
    d = json.loads((an / "rotation.json").read_text())
    assert d["eval"] == {**d["eval"], "split": "test", "task": "t0", "n_samples": 24}
    assert [c["label"] for c in d["checkpoints"]] == ["init", "0", "1"]
    sam_v = next(t for t in d["tables"] if t["analysis"] == "sam" and t["modality"] == "vision")
    assert all(r["n"] == 24 * 23 // 2 for r in sam_v["rows"])
    for t in d["tables"]:
        for r in t["rows"]:
            if r["n"]:
                assert sum(r["percent"]) == pytest.approx(100.0)
    for f in (
        "rotation.md",
        "rotation_sam_text.csv",
        "rotation_imav_image-text.csv",
        "rotation_ram.png",
    ):
        assert (an / f).stat().st_size > 0


def test_cli_rotation_options(two_runs, tmp_path, capsys):
    from cvl.cli import main

    run, _ = two_runs
    out = tmp_path / "o"
    argv = ["analyze", "rotation", "--run", str(run), "--tasks", "0,t1", "--modality", "vision"]
    argv += ["--max-samples", "10", "--out", str(out), "--no-plots", "--quiet"]
    assert main(argv) == 0
    d = json.loads((out / "rotation.json").read_text())
    assert [t["analysis"] + "_" + t["modality"] for t in d["tables"]] == [
        "sam_vision",
        "ram_vision",
    ]
    assert (
        d["tables"][0]["rows"][0]["label"] == "SAM_{0-1}" and d["tables"][0]["rows"][0]["n"] == 45
    )
    assert not list(out.glob("*.png"))


def test_cli_rotation_compare(two_runs, tmp_path, capsys):
    from cvl.cli import main

    r1, r2 = two_runs
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "analyze",
                "rotation",
                "--compare",
                str(r1),
                str(r2),
                "--out",
                str(out),
                "--max-samples",
                "12",
                "--no-plots",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "A = `seqft` vs B = `modx`" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| SAM_{0-1} |"))
    assert "% / " in line and line.count("—") == 0
    assert (out / "compare.md").read_text() in text
    assert (out / "seqft" / "rotation.json").is_file() and (
        out / "modx" / "rotation.json"
    ).is_file()


@pytest.mark.parametrize(
    "extra, msg",
    [
        ([], "exactly one of --run"),
        (["--run", "/no/such/run"], "not a run folder"),
        (["--run", "RUN", "--split", "nosuch"], "no eval set 'nosuch'"),
        (["--run", "RUN", "--tasks", "5"], "no checkpoint '5'"),
        (["--run", "RUN", "--max-samples", "0"], "must be an integer >= 1"),
        (["--run", "RUN", "--max-samples", "1"], "at least 2"),
    ],
)
def test_cli_rotation_errors(two_runs, extra, msg, capsys):
    from cvl.cli import main

    argv = [
        "analyze",
        "rotation",
        "--quiet",
        *(str(two_runs[0]) if a == "RUN" else a for a in extra),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


ROTATION_ROWS = [
    {"modality": "vision", "precision": "no"},
    {"modality": "text", "precision": "bf16"},
    {"modality": "both", "precision": "fp16"},
]


def test_every_value_of_every_rotation_choice_option_runs(two_runs, tmp_path, capsys):
    """Every value of `cvl analyze rotation`'s choice options (checked against click's
    choices) analyses a run, or says in one line why it cannot (issue 47)."""
    import click

    from cvl.cli import cli, main

    cmd = cli.get_command(click.Context(cli), "analyze").get_command(click.Context(cli), "rotation")
    for p in cmd.params:
        if isinstance(p, click.Option) and isinstance(p.type, click.Choice):
            assert set(p.type.choices) <= {r[p.name] for r in ROTATION_ROWS}, p.name
    run, _ = two_runs
    for i, row in enumerate(ROTATION_ROWS):
        out = tmp_path / f"o{i}"
        argv = ["analyze", "rotation", "--run", str(run), "--tasks", "0,t1", "--max-samples", "10"]
        argv += ["--out", str(out), "--no-plots", "--quiet"]
        argv += [x for k, v in row.items() for x in (f"--{k}", v)]
        rc = main(argv)
        err = capsys.readouterr().err.strip()
        if rc == 0:
            assert json.loads((out / "rotation.json").read_text())["tables"], row
        else:
            lines = [ln for ln in err.splitlines() if not ln.startswith("warning: ")]
            assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (row, err)
