"""The paper recipes (recipes/*.sh): valid bash, --help, and their --smoke pipelines end to end.

The smoke tests run every recipe's --smoke mode whole (synthetic stand-ins for the protocols'
data, tiny models, CPU) through a `cvl` that runs each command in a process forked from a
server that imported the libraries once (cvl_server.py: the imports were about as long as a
tiny run), and check each setting's comparison table has exactly one row per method, in the
recipe's order, with numbers in it. One `make smoke` run takes about 9 minutes of wall time
on 2 cores (17 with a fresh interpreter per command), so they carry the `recipes` marker:
`make test` leaves them out, `make smoke` runs them (two at a time), CI runs both.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from device_helpers import dist_env

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SERVER_PY = Path(__file__).resolve().parent / "cvl_server.py"
PAPER_RECIPES = [
    "ctp_p9d.sh",
    "incclip_cc12m.sh",
    "modx.sh",
    "dha_citm.sh",
    "dkr.sh",
    "tic.sh",
    "mtil.sh",
]
FOMO = "fomo.sh"  # FoMo-in-Flux-style study (test_fomo_smoke)
CCLIP = "cclip.sh"  # C-CLIP's protocol (test_cclip_smoke)


def _env(tmp_path: Path, server: str | None = None, **extra: str) -> dict[str, str]:
    """Environment with CVL pointing at `python -m cvl` of this interpreter (or, with `server`,
    at a cvl_server.py client: the same command in a process forked from one that imported
    the libraries already), ACCELERATE at the accelerate installed beside it."""
    cvl = tmp_path / "cvl"
    how = f'"{SERVER_PY}" client' if server else "-m cvl"
    cvl.write_text(f'#!/bin/sh\nexec "{sys.executable}" {how} "$@"\n')
    cvl.chmod(0o755)
    acc = str(Path(sys.executable).parent / "accelerate")
    env = {"OMP_NUM_THREADS": "1", "CVL": str(cvl), "ACCELERATE": acc, **extra}
    return {**os.environ, **env, **({"CVL_SERVER": server} if server else {})}


@pytest.fixture(scope="module")
def cvl_server() -> Iterator[str]:
    """A cvl_server.py for this module's smoke runs (one per xdist worker): the ~100 `cvl`
    commands of `make smoke` skip importing torch, torchvision, open_clip and timm each
    (about half of a tiny run's time); its socket path."""
    d = Path(tempfile.mkdtemp(prefix="cvl-srv-"))  # short: a Unix socket path is <= 107 bytes
    sock = str(d / "s")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SERVER_PY), "serve", sock]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.poll()
        yield sock
    finally:
        p.terminate()
        p.wait()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("name", [*PAPER_RECIPES, FOMO, CCLIP])
def test_recipe_is_valid_bash_with_help(name, tmp_path):
    """`bash -n` parses it; --help prints its header and the common options, exit 0."""
    path = RECIPES / name
    assert path.is_file()
    subprocess.run(["bash", "-n", str(path)], check=True)
    r = subprocess.run(["bash", str(path), "--help"], capture_output=True, text=True, check=True)
    assert "--smoke" in r.stdout and "--nproc" in r.stdout
    bad = subprocess.run(["bash", str(path), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option '--bogus'" in bad.stderr
    for opt, what in (("--methods", "method"), ("--settings", "setting")):  # before any work
        out = tmp_path / opt
        cmd = ["bash", str(path), opt, "nope", "--out", str(out)]
        bad = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True)
        assert bad.returncode == 2 and f"unknown {what} 'nope'" in bad.stderr, bad.stderr
        assert not out.exists()


def test_multi_process_training_goes_through_accelerate(tmp_path):
    """--nproc 2 --nnodes 2 launches `accelerate launch` with the world size, the node's rank and
    the per-process share of the YAML's global batch (a fake accelerate records its arguments)."""
    log = tmp_path / "accelerate.args"
    fake = tmp_path / "accelerate"
    fake.write_text(f'#!/bin/sh\necho "$@" > "{log}"\n')
    fake.chmod(0o755)
    script = (
        f'source "{RECIPES}/lib.sh"; parse_args --nproc 2 --nnodes 2 --node-rank 1 '
        f'--main-addr h0; train "{RECIPES}/configs/dkr.yaml" RUN --stream S --method dkr'
    )
    env = _env(tmp_path, ACCELERATE=str(fake))
    subprocess.run(["bash", "-c", script], env=env, check=True)
    args = log.read_text().split()
    # --multi_gpu: without it accelerate starts ONE process on a machine with no GPU
    assert args[:4] == ["launch", "--multi_gpu", "--num_processes", "4"]
    i = args.index("--machine_rank")
    assert args[i + 1] == "1" and "h0" in args
    assert args[args.index("-m") + 1 : args.index("-m") + 3] == ["cvl", "train"]
    assert args[args.index("--batch-size") + 1] == "70"  # DKR's global 280 over 4 processes
    odd = subprocess.run(
        ["bash", "-c", script.replace("--nnodes 2", "--nnodes 3")], env=env, capture_output=True
    )
    assert odd.returncode == 2 and b"not divisible" in odd.stderr


@pytest.mark.parametrize(
    ("yaml", "args", "env", "want"),
    [  # IncCLIP: global 4096, at most 512 per process (its YAML); DKR: no cap (global 280)
        ("incclip_cc12m", "", {}, "--batch-size 512 --grad-accum 8 --accum-mode cached"),
        ("incclip_cc12m", "--nproc 2", {}, "--batch-size 512 --grad-accum 4 --accum-mode cached"),
        ("incclip_cc12m", "--nproc 8", {}, "--batch-size 512"),  # the paper's 8 GPUs x 512
        (
            "incclip_cc12m",
            "--max-batch-per-process 1024",
            {},
            "--batch-size 1024 --grad-accum 4 --accum-mode cached",
        ),
        ("incclip_cc12m", "", {"MAX_BATCH_PER_PROCESS": "0"}, "--batch-size 4096"),
        (
            "incclip_cc12m",
            "",
            {"ACCUM_MODE": "plain"},
            "--batch-size 512 --grad-accum 8 --accum-mode plain",
        ),
        (
            "incclip_cc12m",
            "--max-batch-per-process 300",
            {},
            "error: per-process batch 4096 does not split into 14",
        ),
        ("dkr", "", {}, "--batch-size 280"),
        (
            "dkr",
            "--max-batch-per-process 70",
            {},
            "--batch-size 70 --grad-accum 4 --accum-mode cached",
        ),
    ],
)
def test_a_recipe_keeps_the_global_batch_on_fewer_processes(yaml, args, env, want):
    """lib.sh's batch_args: the per-process share of the YAML's global batch, split into K
    cached micro-batches when it exceeds the cap (a K that does not divide it: one line)."""
    script = (
        f'source "{RECIPES}/lib.sh"; parse_args {args}; batch_args "{RECIPES}/configs/{yaml}.yaml"'
    )
    r = subprocess.run(
        ["bash", "-c", script], env={**os.environ, **env}, capture_output=True, text=True
    )
    if want.startswith("error"):
        assert r.returncode == 2 and r.stderr.startswith(want) and r.stdout == "", r
    else:
        assert r.returncode == 0 and r.stdout.strip() == want, r


@pytest.mark.parametrize(
    ("args", "settings", "want"),
    [
        ("--smoke", "a b", "x"),  # the first setting runs too: the later one trains the subset
        ("--smoke", "b", "x y z"),  # alone, a later setting trains every method
        ("--smoke --methods 'x y z'", "a b", "x y z"),  # --methods: in every setting
        ("", "a b", "x y z"),  # the full protocol: every method everywhere
    ],
)
def test_smoke_subset_only_beside_the_first_setting(args, settings, want):
    """lib.sh's smoke_subset: a later setting's smoke subset applies in the smoke mode, without
    --methods, when the first setting (which trains every method) runs as well."""
    script = (
        f'source "{RECIPES}/lib.sh"; parse_args {args}; METHODS=${{METHODS:-"x y z"}}; '
        f'SETTINGS="{settings}"; smoke_subset a "x"'
    )
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert r.stdout.split() == want.split()


def _rows(table: Path) -> list[dict[str, str]]:
    with table.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


CTP = "joint seqft ewc si mas afec rwalk lwf ctp er mof kmeans icarl lucir ctp-er"
INCCLIP = "er lucir geodl co2l incclip"
MODX = "seqft ewc lwf der modx joint"
DKR = "joint zeroshot seqft ewc lwf erl afc modx dkr"
MTIL = "zeroshot seqft icarl zscl ties seqft-lora"  # the smoke's default methods
# recipe -> {setting folder: (methods in table order, task count, benchmarks)}: the first
# setting trains every method of the paper's list, the later ones the recipe's smoke subset
# (lib.sh's smoke_subset: their streams and setting-specific arguments, end to end)
SMOKES = {
    "ctp_p9d.sh": {"default": (CTP, 9, []), "reversed": ("seqft ctp ctp-er", 9, [])},
    "incclip_cc12m.sh": {
        "class4": (INCCLIP, 4, ["coco-5k", "f30k-1k"]),
        "class8": ("er incclip", 8, ["coco-5k", "f30k-1k"]),
        "instance": ("er incclip", 4, ["coco-5k", "f30k-1k"]),
    },
    "modx.sh": {
        "coco-f30k": (MODX, 6, ["coco-5k", "f30k-1k"]),
        "ec": ("seqft modx", 5, ["ec-5k", "coco-5k", "f30k-1k"]),
        "cc12m": ("seqft modx", 10, ["coco-5k", "f30k-1k"]),
    },
    "dha_citm.sh": {"": ("seqft lwf er der co2l dha dha-dagger", 4, [])},
    "dkr.sh": {
        "s1": (DKR, 5, []),
        "s2": ("seqft dkr", 5, ["f30k-1k", "coco-5k", "ec-5k"]),
    },
    # TiC's policies; the per-period retrieval sets are benchmarks of the stream's time layout
    "tic.sh": {"": ("sequential cumulative-all cumulative-equal cumulative-exp oracle", 3, [])},
    "mtil.sh": {"order1": (MTIL, 3, [])},
}


@pytest.mark.recipes
@pytest.mark.parametrize("name", list(SMOKES))
def test_recipe_smoke(name, tmp_path, cvl_server):
    """`RECIPE --smoke` (build -> train every method, in the first setting, the recipe's smoke
    subset in the later ones -> eval -> compare) runs green on the CPU; every setting's stream
    has the protocol's task count and benchmarks; its compare.csv and
    compare.json have one row per method, in the recipe's order, with a finite Rm and the
    benchmarks' columns; Mod-X writes the rotation analysis; (DHA) a rerun retrains nothing and
    --nproc 2 trains in two processes."""
    out = tmp_path / "out"
    cmd = ["bash", str(RECIPES / name), "--smoke", "--out", str(out)]
    r = subprocess.run(cmd, env=_env(tmp_path, cvl_server), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for setting, (methods, n_tasks, bench) in SMOKES[name].items():
        d = out / setting
        runs = [row["run"] for row in _rows(d / "compare" / "compare.csv")]
        assert runs == methods.split()
        cj = json.loads((d / "compare" / "compare.json").read_text())
        assert [row["run"] for row in cj["runs"]] == runs
        for row in cj["runs"]:
            assert 0.0 <= row["Rm"] <= 100.0, row
            for b in bench:
                assert 0.0 <= row[f"{b} Rm"] <= 100.0, (b, row)
        stream = json.loads((d / "runs" / runs[0] / "run.json").read_text())["stream"]
        assert len(stream["task_order"]) == n_tasks
        manifest = json.loads((Path(stream["path"]) / "stream.json").read_text())
        periods = set(((manifest.get("time") or {}).get("eval") or {}).values())
        assert [b for b in manifest.get("benchmarks") or {} if b not in periods] == bench
    if name == "tic.sh":  # 4 yearly periods (2 merged into the first step), TiC's columns
        cj = json.loads((out / "compare" / "compare.json").read_text())
        for row in cj["runs"]:
            assert all(0.0 <= row[c] <= 100.0 for c in ("ID (TiC)", "backward (TiC)")), row
        oracle = json.loads((out / "runs" / "oracle" / "eval" / "metrics.json").read_text())
        assert oracle["tic"]["periods"] == ["2014", "2015", "2016", "2017"]
        assert len(oracle["tic"]["rows"]) == 3
    if name == "mtil.sh":  # ZSCL Table 1's columns, MTIL's and X-TAIL's
        for row in json.loads((out / "order1" / "compare" / "compare.json").read_text())["runs"]:
            for k in ("Transfer", "Avg.", "Last"):
                assert 0.0 <= row[f"MTIL {k}"] <= 100.0 and 0.0 <= row[f"X-TAIL {k}"] <= 100.0
    if name == "modx.sh":
        for setting in SMOKES[name]:
            assert (out / setting / "runs" / "seqft" / "analysis").is_dir()
    if name == "dha_citm.sh":  # a rerun finds every stream, run and evaluation finished
        again = subprocess.run(cmd, env=_env(tmp_path, cvl_server), capture_output=True, text=True)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "reusing" in again.stdout and "saved" not in again.stdout
        # --nproc 2 really trains in 2 processes (accelerate launch), each with half the batch
        two = [*cmd[:-1], str(tmp_path / "two"), "--nproc", "2", "--methods", "dha"]
        r = subprocess.run(
            two, env=dist_env(2, _env(tmp_path, cvl_server)), capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        run = json.loads((tmp_path / "two" / "runs" / "dha" / "run.json").read_text())
        assert run["processes"] == 2 and run["config"]["batch_size"] == 4  # smoke: global 8


@pytest.mark.recipes
def test_fomo_smoke(tmp_path, cvl_server):
    """`recipes/fomo.sh --smoke`: CLIP_0 on a synthetic pretraining set, then three runs (no
    mixture + per-task cosine; the mixture + the cosine and the rsqrt autoregressive
    meta-schedules) at the same 12 steps per task on 3 adaptation tasks with 2 held-out
    benchmarks; compare.json has one row per run with finite A_KA, A_ZS and GM; the mixed
    runs record their split (FoMo's first-task rule on task 0)."""
    out = tmp_path / "out"
    cmd = ["bash", str(RECIPES / FOMO), "--smoke", "--out", str(out)]
    r = subprocess.run(cmd, env=_env(tmp_path, cvl_server), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cj = json.loads((out / "compare" / "compare.json").read_text())
    assert [row["run"] for row in cj["runs"]] == ["ft", "mix-ar", "mix-rsqrt-ar"]
    for row in cj["runs"]:
        for col in ("A_KA", "A_ZS", "GM (FoMo)"):
            assert 0.0 <= row[col] <= 100.0, (col, row)
        assert abs(row["GM (FoMo)"] ** 2 - row["A_KA"] * row["A_ZS"]) < 1e-6
    m = json.loads((out / "runs" / "mix-ar" / "eval" / "metrics.json").read_text())
    assert m["fomo"]["held_out"] == ["held-t3", "held-t4"] and m["fomo"]["rows"][0] == "init"
    for run in ("mix-ar", "mix-rsqrt-ar"):
        rj = json.loads((out / "runs" / run / "run.json").read_text())
        assert rj["mixture"]["sizes"] == {"pretrain": 3, "task": 3, "buffer": 2}  # 8 · 0.33...
        t0 = json.loads((out / "runs" / run / "tasks" / "00-t0" / "task.json").read_text())
        assert t0["mixture"]["per_batch"] == {"pretrain": 4, "task": 4, "buffer": 0}
        assert t0["steps"] == 12


@pytest.mark.recipes
def test_cclip_smoke(tmp_path, cvl_server):
    """`recipes/cclip.sh --smoke`: C-CLIP's eight tasks in its order (synthetic stand-ins), a
    held-out domain as the zero-shot classification folder, CLIP_0, then C-CLIP and the
    separate per-task LoRAs (both with --tune lora); compare.json has both runs with a finite
    Rm and zero-shot retention (A_ZS); each evaluation scores the start first."""
    out = tmp_path / "out"
    cmd = ["bash", str(RECIPES / CCLIP), "--smoke", "--out", str(out)]
    r = subprocess.run(cmd, env=_env(tmp_path, cvl_server), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cj = json.loads((out / "compare" / "compare.json").read_text())
    assert [row["run"] for row in cj["runs"]] == ["cclip", "lora-per-task"]
    for row in cj["runs"]:
        for col in ("Rm", "A_ZS"):
            assert 0.0 <= row[col] <= 100.0, (col, row)
    order = ["flickr30k", "coco", "pets", "lexica", "simpsons", "wikiart", "kream", "sketch"]
    for run, method in (("cclip", "cclip"), ("lora-per-task", "lora_per_task")):
        rj = json.loads((out / "runs" / run / "run.json").read_text())
        assert rj["stream"]["task_order"] == order
        assert rj["config"]["method"] == method and rj["config"]["tune"] == "lora"
        m = json.loads((out / "runs" / run / "eval" / "metrics.json").read_text())
        assert m["fomo"]["rows"][0] == "init" and len(m["fomo"]["zs"]) == 9
        assert m["fomo"]["held_out"] == [str(out / "heldout" / "t8")]
