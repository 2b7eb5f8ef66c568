"""End-to-end `cvl eval` on a fake 2-task run of a tiny model over the synthetic stream."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cvl.cli import main

# one worker builds the module fixture (an evaluated run) for every test here
pytestmark = pytest.mark.xdist_group("eval_e2e")


def make_run(
    root, stream, kind="clip", config="tiny", tasks=("t0", "t1"), init=True, method="seqft"
):
    """A run folder as the trainer writes it, with random weights per checkpoint."""
    from cvl.io import write_json
    from cvl.models import build_model, save_weights
    from cvl.streams.manifest import load_manifest

    m = load_manifest(stream)
    torch.manual_seed(0)
    model = build_model(kind, config)
    write_json(
        root / "run.json",
        {
            "schema": "cvl.run/1",
            "config": {
                "method": method,
                "model": kind,
                "model_config": config,
                "stream": str(stream),
            },
            "model": model.config(),
            "stream": {
                "path": str(stream),
                "name": m.name,
                "task_order": list(m.task_order),
                "fingerprint": m.fingerprint,
            },
        },
    )
    if init:
        save_weights(model, root / "init" / "model.safetensors")
    for i, t in enumerate(tasks):  # a different random model per task (one build: faster)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        save_weights(model, root / "tasks" / f"{i:02d}-{t}" / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def evaluated_run(synth_stream, tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("runs") / "a", synth_stream)
    rc = main(["eval", "--run", str(run), "--quiet", "--probe-train", "24", "--batch-size", "64"])
    assert rc == 0
    return run


def test_eval_writes_every_output(evaluated_run, capsys):
    ev = evaluated_run / "eval"
    for f in (
        "metrics.json",
        "summary.md",
        "r_matrix.csv",
        "cumulative.csv",
        "continual.csv",
        "table_final.csv",
        "so_far_vs_final.csv",
        "per_task_final.csv",
    ):
        assert (ev / f).is_file(), f
    assert (ev / "plots" / "heatmap_Rm.png").is_file() and (
        ev / "plots" / "curves_Rm.png"
    ).is_file()
    assert (ev / "plots" / "heatmap_mAP1.png").is_file()
    assert sorted(p.name for p in (ev / "cache").iterdir()) == [
        "00-t0.json",
        "01-t1.json",
        "init.json",
    ]
    m = json.loads((ev / "metrics.json").read_text())
    assert (
        m["schema"] == "cvl.eval/1"
        and m["tasks"] == ["t0", "t1", "t2"]
        and m["rows"] == ["00-t0", "01-t1"]
    )
    assert m["protocol"]["match"] == "text" and "identical" in m["protocol"]["retrieval_rule"]
    assert (
        "image+text" not in m["protocol"]["map_feature"]
        or "normalise" in m["protocol"]["map_feature"]
    )
    for k in (
        "TR@1",
        "IR@10",
        "Rm",
        "TR@mean",
        "IR@mean",
        "mAP@1",
        "mAP@10/code",
        "mAP@5/pos",
        "ZS-top1",
        "LP-top1",
    ):
        mat = m["matrices"][k]
        assert len(mat) == 2 and all(len(r) == 3 for r in mat), k
        assert all(v is not None and 0 <= v <= 100 for r in mat for v in r), k
    # Zero-shot row from init/ -> FWT; continual metrics over the 2 x 2 leading block.
    assert m["has_init"] and len(m["zero_shot_row"]["Rm"]) == 3
    c = m["continual"]["Rm"]
    R = m["matrices"]["Rm"]
    assert c["bwt_standard"] == pytest.approx(R[1][0] - R[0][0])
    assert c["fwt"] == pytest.approx(R[0][1] - m["zero_shot_row"]["Rm"][1])
    assert c["average_final"] == pytest.approx((R[1][0] + R[1][1]) / 2)
    # CTP protocol: C[i][k] for k <= i; the model after t0 on t0 alone equals R[0][0].
    C = m["cumulative"]["Rm"]
    assert C[0][0] == pytest.approx(R[0][0]) and C[0][1] is None and C[1][1] is not None
    sf = m["so_far_vs_final"]["Rm"]
    assert sf[0]["final"] == pytest.approx(C[1][0]) and sf[1]["so_far"] == pytest.approx(C[1][1])
    assert m["final"]["Rm"] == pytest.approx(C[1][1])
    md = (ev / "summary.md").read_text()
    assert (
        "CTP Table 1" in md and "DHA Table 1" in md and "BWT (IncCLIP)" in md and "identical" in md
    )


def test_rerun_uses_cache_and_force_recomputes(evaluated_run, capsys):
    before = json.loads((evaluated_run / "eval" / "metrics.json").read_text())
    assert (
        main(["eval", "--run", str(evaluated_run), "--quiet", "--probe-train", "24", "--no-plots"])
        == 0
    )
    out = capsys.readouterr().out
    assert "evaluated 0 checkpoint(s), reused 3 from cache" in out
    assert "CTP Table 1" in out and "so far" in out and "BWT" in out  # the paper-style tables
    after = json.loads((evaluated_run / "eval" / "metrics.json").read_text())
    assert after["matrices"] == before["matrices"]
    # Another option that changes numbers invalidates the cache; --tasks last evaluates only t1.
    assert (
        main(
            [
                "eval",
                "--run",
                str(evaluated_run),
                "--quiet",
                "--probe-train",
                "24",
                "--no-plots",
                "--tasks",
                "last",
                "--match",
                "pair",
                "--out",
                str(evaluated_run / "eval-pair"),
            ]
        )
        == 0
    )
    m = json.loads((evaluated_run / "eval-pair" / "metrics.json").read_text())
    assert m["evaluated"] == ["01-t1"] and m["rows"] == ["00-t0", "01-t1"]
    assert (
        m["matrices"]["Rm"][0] == [None, None, None]
        and m["continual"]["Rm"]["bwt_standard"] is None
    )
    assert m["protocol"]["match"] == "pair"
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--run",
                str(evaluated_run),
                "--quiet",
                "--probe-train",
                "24",
                "--no-plots",
                "--tasks",
                "t0",
                "--force",
                "--image-cache-mb",
                "0",
            ]
        )
        == 0
    )
    assert "evaluated 1 checkpoint(s), reused 2" in capsys.readouterr().out
    # Re-decoded from the JPEGs (no image cache, fresh process state): the same numbers as the
    # first run, where t0's images came from the cache filled while evaluating init/.
    again = json.loads((evaluated_run / "eval" / "metrics.json").read_text())
    assert again["matrices"] == before["matrices"] and again["cumulative"] == before["cumulative"]


def test_compare_runs(evaluated_run, tmp_path, capsys):
    other = tmp_path / "b"
    shutil.copytree(evaluated_run, other, ignore=shutil.ignore_patterns("eval*"))
    rj = json.loads((other / "run.json").read_text())
    rj["config"]["method"] = "er"
    (other / "run.json").write_text(json.dumps(rj))
    rc = main(
        [
            "eval",
            "--compare",
            str(evaluated_run),
            str(other),
            "--quiet",
            "--probe-train",
            "24",
            "--out",
            str(tmp_path / "cmp"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "seqft" in out and "| b | er |" in out and "mAP@1" in out
    assert (tmp_path / "cmp" / "compare.csv").is_file() and (
        other / "eval" / "metrics.json"
    ).is_file()
    assert (tmp_path / "cmp" / "compare_Rm.png").is_file()  # the comparison curves
    cj = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["run"] for r in cj["runs"]] == [evaluated_run.name, "b"]
    assert not (other / "eval" / "plots").exists()  # per-run plots: `cvl eval --run`


def test_joint_run_has_a_final_merged_row(synth_stream, tmp_path):
    """One checkpoint after the last task (joint): no R-matrix diagonal, but a final model."""
    run = make_run(tmp_path / "j", synth_stream, tasks=("t0",), init=False, method="joint")
    (run / "tasks" / "00-t0").rename(run / "tasks" / "02-t2")
    rc = main(["eval", "--run", str(run), "--quiet", "--no-plots", "--no-probe", "--no-zeroshot"])
    assert rc == 0
    m = json.loads((run / "eval" / "metrics.json").read_text())
    assert m["rows"] == ["02-t2"] and m["continual"] == {}
    assert 0.0 <= m["final"]["Rm"] <= 100.0 and m["final"]["TR@1"] is not None


def test_zeroshot_folder_from_the_cli(evaluated_run, tmp_path):
    from PIL import Image

    for cls, rgb in (("red_thing", (250, 10, 10)), ("blue_thing", (10, 10, 250))):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        Image.new("RGB", (32, 32), rgb).save(tmp_path / "imgs" / cls / "0.png")
    out = tmp_path / "ev"
    argv = [
        "eval",
        "--run",
        str(evaluated_run),
        "--tasks",
        "last",
        "--quiet",
        "--no-plots",
        "--no-probe",
    ]
    assert main([*argv, "--zeroshot-folder", str(tmp_path / "imgs"), "--out", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    r = m["folders"]["01-t1"][str(tmp_path / "imgs")]
    assert r["n"] == 2 and r["n_classes"] == 2 and 0 <= r["top1"] <= 100
    assert "image folder" in (out / "summary.md").read_text()


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["eval"], "Missing option '--run'"),
        (["eval", "--run", "/no/such/run"], "not a run folder"),
        (["eval", "--compare"], "--compare needs run folders"),
    ],
)
def test_errors_are_one_line(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_bad_task_selection(evaluated_run, capsys):
    assert main(["eval", "--run", str(evaluated_run), "--tasks", "t9", "--quiet"]) == 2
    assert "no finished task 't9'" in capsys.readouterr().err


def test_fusion_model_uses_fusion_cls(synth_stream, tmp_path):
    """A fusion model's mAP uses its fusion [CLS] (embed.py `fusion=True`)."""
    from cvl.evaluation.runner import EvalOptions, evaluate_run

    run = make_run(tmp_path / "f", synth_stream, kind="fusion", tasks=("t0",), init=False)
    opts = EvalOptions(progress=False, probe=False, zeroshot=False, batch_size=32)
    m = evaluate_run(run, opts)
    assert "fusion encoder" in m["protocol"]["map_feature"]
    assert m["matrices"]["mAP@1"][0][0] is not None and m["final"]["mAP@1"] is not None


# Every value of every choice option of `cvl eval`, on a copy of the evaluated run (its
# embedding cache reused where the value does not change the embeddings); checked against
# click's choices, so a new value needs a row (issue 47: a documented option never ends in a
# traceback).
EVAL_ROWS = [
    {"match": "pair", "ties": "optimistic", "map_feature": "image+text", "precision": "bf16"},
    {"match": "text", "ties": "pessimistic", "map_feature": "image", "precision": "no"},
    {"match": "auto", "map_feature": "text", "precision": "fp16"},
    {"map_feature": "fusion"},
    {"map_feature": "auto"},
]


def test_every_value_of_every_eval_choice_option_has_a_row():
    import click

    from cvl.cli import cli

    missing = []
    for p in cli.get_command(click.Context(cli), "eval").params:
        if isinstance(p, click.Option) and isinstance(p.type, click.Choice):
            ran = {r.get(p.name) for r in EVAL_ROWS}
            missing += [f"--{p.name.replace('_', '-')} {v}" for v in p.type.choices if v not in ran]
    assert not missing, missing


@pytest.mark.parametrize("row", EVAL_ROWS, ids=lambda r: "-".join(r.values()))
def test_every_eval_choice_value_evaluates_or_says_why_in_one_line(
    evaluated_run, tmp_path, capsys, row
):
    run = tmp_path / "run"
    shutil.copytree(evaluated_run, run)
    argv = ["eval", "--run", str(run), "--quiet", "--no-probe", "--no-plots"]
    for k, v in row.items():
        argv += [f"--{k.replace('_', '-')}", v]
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    if rc == 0:
        m = json.loads((run / "eval" / "metrics.json").read_text())
        assert m["matrices"]  # scored
    else:  # a value this model or machine cannot take: refused in one line, no traceback
        lines = [ln for ln in err.splitlines() if not ln.startswith("warning: ")]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
