"""The issue's end-to-end check: from DataComp-format shards cvl did not write, served over
HTTP (a loopback server honouring byte ranges, read-only: the index lives under a prefix),
one `cvl build-stream shards` command each makes (a) a 5-task instance split and (b) TiC's
yearly stream from its uid files, in place; both train, a SIGKILLed training resumes to the
bits of an uninterrupted one (with a replay buffer; TiC's cumulative policy), and `cvl eval`
scores them. The same from a local folder is `test_shards_source.py`'s (cheap) business.

Marked `matrix` (make matrix; CI): about a minute of training and evaluation."""

from __future__ import annotations

import json
import random

import pytest
from reliability_helpers import assert_same_run, cli, kill_when, log_lines, train_argv
from remote_helpers import RangeServer
from shards_helpers import fixture_copy, instance_argv, tic_argv

from cvl.streams.manifest import load_manifest

pytestmark = [pytest.mark.matrix, pytest.mark.xdist_group("shards_e2e")]

RUNS = {  # stream -> (extra training arguments, the task the kill lands in)
    "inst": (["--buffer", "reservoir", "--buffer-size", "8"], (1, "chunk1")),
    "tic": (["--method-arg", "cumulative=true"], (0, "2014-2016")),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    dc = fixture_copy(root / "www" / "dc")
    srv = RangeServer(root / "www")
    url = f"{srv.base}/dc/shards/{{00000..00002}}.tar"
    prefix = str(root / "index")  # the bucket is read-only: its index lives here
    cli(instance_argv(url, root / "inst", "--index-prefix", prefix))
    cli(tic_argv(url, dc, root / "tic", "--index-prefix", prefix))
    yield srv, root
    srv.close()


def _argv(root, stream: str, out) -> list[str]:
    argv = train_argv(root / stream, out, "joint" if stream == "tic" else "seqft")
    argv[argv.index("--batch-size") + 1] = "4"  # 2-3 steps per task: a kill lands inside one
    return argv + RUNS[stream][0]


@pytest.mark.parametrize("stream", ["inst", "tic"])
def test_a_stream_over_http_shards_trains_resumes_and_evaluates(served, stream, tmp_path):
    srv, root = served
    m = load_manifest(root / stream)
    src = m.sources[0]
    assert src["url"] == f"{srv.base}/dc/shards" and src["index"] == str(root / "index")
    assert not list((root / "www").rglob("*.idx.*"))  # nothing written beside the shards
    assert len(m.task_order) == (5 if stream == "inst" else 7)
    cli(_argv(root, stream, tmp_path / "whole"))
    srv.requests.clear()
    ti, name = RUNS[stream][1]
    k = random.Random(f"shards/{stream}").randint(1, 2)
    log = tmp_path / "cut" / "logs" / f"{ti:02d}-{name}.jsonl"
    kill_when(_argv(root, stream, tmp_path / "cut"), lambda: log_lines(log) >= k)
    assert not (tmp_path / "cut" / "tasks" / f"{ti:02d}-{name}").exists()
    cli(_argv(root, stream, tmp_path / "cut"))
    assert assert_same_run(tmp_path / "whole", tmp_path / "cut") == len(m.task_order)
    tars = [(p, r) for p, r in srv.requests if p.endswith(".tar")]
    assert tars and all(r and r.startswith("bytes=") for _, r in tars)  # byte ranges only
    cli(["eval", "--run", str(tmp_path / "cut"), "--no-probe", "--no-zeroshot"])
    metrics = json.loads((tmp_path / "cut" / "eval" / "metrics.json").read_text())
    if stream == "tic":  # TiC's 7 x 9 matrix over the yearly retrieval sets
        assert sorted(metrics["benchmarks"]) == [f"ret-{y}" for y in range(2014, 2023)]
