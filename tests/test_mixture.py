"""Data mixtures (cvl/data/mixture.py, `cvl train --mixture`): FoMo-in-Flux's split of a
batch on hand-computed cases (its configs' shares), the first-task rule, exact shares over a
whole task, the epoch definition, and end to end: the shares in run.json / task.json / the
train log, every method with a mixture, a killed run resuming bit for bit, and 2 processes
× batch B training exactly as 1 process × 2B."""

from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
from reliability_helpers import (
    assert_same_run,
    build_tiny_stream,
    cli,
    family_methods,
    kill_when,
    log_lines,
    method_args,
    train_argv,
)

from cvl.data.mixture import (
    batches_per_epoch,
    mixed_epoch,
    mixture_spec,
    parse_mixture,
    split_batch,
    without_buffer,
)
from cvl.data.reader import rank_slice
from cvl.errors import CvlError
from cvl.train.config import TrainConfig


def shares(spec: str) -> dict:
    return parse_mixture(spec)


def test_split_matches_fomo_on_its_configs():
    # continualfomo_default.yaml: batch 512, pretraining 0.33 / update 0.34 / buffer 0.33:
    # floors 168 / 174 / 168 (510), the 2 left over to pretraining then update
    s = split_batch(512, shares("pretrain=0.33,task=0.34,buffer=0.33"))
    assert s == {"pretrain": 169, "task": 175, "buffer": 168}
    # its first task (no buffer yet): 168 // 2 + 168 % 2 = 84 more for the update,
    # 168 // 2 = 84 more for pretraining
    assert without_buffer(s) == {"pretrain": 253, "task": 259, "buffer": 0}
    # oracle.yaml: 0.33 / 0.67 / 0: floors 168 / 343, 1 left over -> pretraining
    assert split_batch(512, shares("pretrain=0.33,task=0.67")) == {
        "pretrain": 169,
        "task": 343,
        "buffer": 0,
    }
    # simple_finetune.yaml: 0.5 / 0.5 / 0 of 128
    assert split_batch(128, shares("pretrain=0.5,task=0.5")) == {
        "pretrain": 64,
        "task": 64,
        "buffer": 0,
    }


def test_split_rules_where_cvl_is_exact():
    # an odd buffer part with a pretraining share: the task takes the extra item
    assert without_buffer({"pretrain": 3, "task": 4, "buffer": 3}) == {
        "pretrain": 4,
        "task": 6,
        "buffer": 0,
    }
    # no pretraining share: the task takes the whole buffer part
    assert without_buffer({"pretrain": 0, "task": 5, "buffer": 5})["task"] == 10
    # exact decimals: 0.29 of 100 is 29 (FoMo's int(100 * 0.29) = 28)
    assert split_batch(100, shares("task=0.29,pretrain=0.71")) == {
        "pretrain": 71,
        "task": 29,
        "buffer": 0,
    }
    # a left-over item never goes to a source without a share (FoMo's loop would give it
    # to pretraining here): 3.5 -> 3, 6.5 -> 6, the 1 left over to the task
    assert split_batch(10, shares("task=0.35,buffer=0.65")) == {
        "pretrain": 0,
        "task": 4,
        "buffer": 6,
    }
    for gb in range(1, 70):  # every batch adds up
        for spec in ("task=0.34,buffer=0.33,pretrain=0.33", "task=0.1,pretrain=0.9"):
            s = split_batch(gb, shares(spec))
            assert sum(s.values()) == gb and sum(without_buffer(s).values()) == gb


def test_mixture_spec_parsing():
    assert mixture_spec(shares("task = 0.34, buffer=0.33,pretrain=0.33")) == (
        "pretrain=0.33,task=0.34,buffer=0.33"
    )
    assert parse_mixture({"task": 1})["task"] == Fraction(1)
    assert parse_mixture(None) is None
    for bad, why in (
        ("task=0.5,buffer=0.4", "sum to 1"),
        ("task=0.5,replay=0.5", "unknown source 'replay'"),
        ("task=0,pretrain=1", "task's share must be positive"),
        ("task=x", "not a number"),
        ("task", "expected SOURCE=SHARE"),
        ("task=1.5,pretrain=-0.5", "negative"),
    ):
        with pytest.raises(CvlError, match=why):
            parse_mixture(bad)


def test_mixture_options_must_agree():
    base = dict(stream="S", out="O")
    cfg = TrainConfig(
        **base, mixture="task=0.5,pretrain=0.5", pretrain_data="P", buffer=None
    ).validate()
    assert cfg.mixture == "pretrain=0.5,task=0.5,buffer=0"
    for kw, why in (
        (dict(mixture="task=0.5,pretrain=0.5"), "add --pretrain-data"),
        (dict(mixture="task=1", pretrain_data="P"), "no share"),
        (dict(pretrain_data="P"), "add --mixture"),
        (dict(mixture="task=0.5,buffer=0.5"), "add --buffer"),
        (dict(mixture="task=1", buffer="reservoir", buffer_size=4), "never be replayed"),
    ):
        with pytest.raises(CvlError, match=why):
            TrainConfig(**base, **kw).validate()


def _source_of(counts: dict, i: int) -> str:
    if i < counts["task"]:
        return "task"
    return "buffer" if i < counts["task"] + counts["buffer"] else "pretrain"


def test_every_batch_holds_the_shares_and_an_epoch_is_one_pass_over_the_task():
    counts = {"task": 50, "buffer": 7, "pretrain": 30}
    sizes = {"task": 6, "buffer": 3, "pretrain": 3}
    per = batches_per_epoch(50, 6)
    assert per == 8  # floor(50 / 6): the remainder of each epoch's permutation left out
    seen = Counter()
    epochs = [mixed_epoch(counts, sizes, per, seed=5, epoch=e) for e in range(3)]
    assert epochs[0] == mixed_epoch(counts, sizes, per, seed=5, epoch=0)  # (seed, epoch) only
    assert epochs[0] != epochs[1]
    for batches in epochs:
        assert len(batches) == per
        task_items = []
        for b in batches:
            src = Counter(_source_of(counts, i) for i, _ in b)
            assert src == Counter(sizes)  # exact shares in every global batch
            # listed task, then buffer, then pretraining items
            assert [_source_of(counts, i) for i, _ in b] == sorted(
                (_source_of(counts, i) for i, _ in b), key=["task", "buffer", "pretrain"].index
            )
            task_items += [i for i, _ in b if i < 50]
            seen.update(i for i, _ in b if i >= 50)
            # 2 ranks take halves: together the global batch, each the same size
            halves = [rank_slice(b, r, 2) for r in range(2)]
            assert halves[0] + halves[1] == b and len(halves[0]) == len(halves[1])
        assert len(task_items) == len(set(task_items)) == 48  # each task item at most once
    # buffer / pretraining streams run on across epochs, every item as often (±1)
    buf = [seen[i] for i in range(50, 57)]
    pre = [seen[i] for i in range(57, 87)]
    assert sum(buf) == 3 * 8 * 3 and max(buf) - min(buf) <= 1
    assert sum(pre) == 3 * 8 * 3 and max(pre) - min(pre) <= 1
    # augmentation seeds differ per visit
    augs = [a for batches in epochs for b in batches for _, a in b]
    assert len(set(augs)) == len(augs)


def test_a_task_smaller_than_its_share_still_fills_each_batch():
    batches = mixed_epoch(
        {"task": 3, "buffer": 0, "pretrain": 5}, {"task": 5, "pretrain": 3}, 1, 0, 0
    )
    assert len(batches) == 1 and len(batches[0]) == 8
    assert sorted(Counter(i for i, _ in batches[0] if i < 3).values())[-1] <= 2


def _mix_args(stream: Path, buffer: bool) -> list[str]:
    spec = "task=0.5,buffer=0.25,pretrain=0.25" if buffer else "task=0.75,pretrain=0.25"
    return ["--mixture", spec, "--pretrain-data", str(stream)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_stream(tmp_path_factory.mktemp("mixture") / "s")


def test_run_records_the_shares(tiny, tmp_path):
    """run.json, every task.json and every log line carry the split; the first task has the
    buffer's part (FoMo's rule), the later ones the nominal split; the task's own items set
    the steps (32 pairs, 4 task items per batch of 8: 8 batches, capped at 4 steps)."""
    run = tmp_path / "run"
    argv = train_argv(tiny, run, "seqft") + ["--buffer", "reservoir", "--buffer-size", "8"]
    cli(argv + _mix_args(tiny, True) + ["--log-every", "1", "--max-steps-per-task", "8"])
    rj = json.loads((run / "run.json").read_text())
    assert rj["mixture"]["sizes"] == {"pretrain": 2, "task": 4, "buffer": 2}
    assert rj["mixture"]["sizes_without_buffer_items"] == {"pretrain": 3, "task": 5, "buffer": 0}
    for t, sizes, steps in (
        ("00-t0", {"pretrain": 3, "task": 5, "buffer": 0}, 6),  # floor(32 / 5)
        ("01-t1", {"pretrain": 2, "task": 4, "buffer": 2}, 8),  # floor(32 / 4)
    ):
        tj = json.loads((run / "tasks" / t / "task.json").read_text())
        assert tj["mixture"]["per_batch"] == sizes and tj["steps"] == steps
        assert tj["mixture"]["items"]["pretrain"] == 96  # the stream's 3 tasks x 32
        lines = (run / "tasks" / t / "train_log.jsonl").read_text().splitlines()
        assert all(json.loads(x)["mixture"] == sizes for x in lines)
        assert tj["cost"]["samples"] == 8 * steps  # every global batch is full


@pytest.mark.slow
@pytest.mark.parametrize("method", family_methods())
def test_every_kind_of_method_trains_with_a_mixture(method, tiny, tmp_path):
    """One method of each kind (`FAMILIES`; its buffer if it needs one, the buffer then a
    source of the mixture)."""
    extra = method_args(method, tiny)
    run = tmp_path / "run"
    argv = train_argv(tiny, run, method) + extra + _mix_args(tiny, "--buffer" in extra)
    cli([*argv, "--max-steps-per-task", "2", "--checkpoint-every", "0"])
    assert (run / "tasks" / "02-t2" / "model.safetensors").is_file()


@pytest.mark.slow
def test_killed_mixture_run_resumes_bitwise(tiny, tmp_path):
    """A mixture with a buffer and a meta-schedule, SIGKILLed inside task 2 and rerun, ends
    bit-identical to an uninterrupted run (weights, buffer, logs, lr)."""
    extra = ["--buffer", "reservoir", "--buffer-size", "8", *_mix_args(tiny, True)]
    extra += ["--lr-schedule", "cosine-ar", "--warmup", "0.25", "--epochs", "2"]
    # batch 16: task 0 takes 10 task items per batch (3 batches an epoch), tasks 1-2 take 8
    # (4 an epoch): 6 steps each cross an epoch end
    extra += ["--batch-size", "16", "--max-steps-per-task", "6"]
    ref = tmp_path / "ref"
    cli(train_argv(tiny, ref, "seqft") + extra)
    out = tmp_path / "run"
    argv = train_argv(tiny, out, "seqft") + extra
    k = 4  # killed at task 2's epoch end (resumes from step 3, 4 or 5)
    log = out / "logs" / "01-t1.jsonl"
    kill_when(argv, lambda: log_lines(log) >= k)
    assert not (out / "tasks" / "01-t1").exists()
    cli(argv)
    assert assert_same_run(ref, out) == 3


@pytest.mark.slow
@pytest.mark.torchrun_pair(
    *("--method", "seqft", "--buffer", "reservoir", "--buffer-size", "16"),
    *("--mixture", "task=0.5,buffer=0.3,pretrain=0.2", "--pretrain-data", "{stream}"),
    *("--lr-schedule", "rsqrt-ar", "--warmup", "1", "--workers", "1"),
)
def test_two_processes_equal_one_with_a_mixture(pair_runs):
    """2 processes × batch 8 = 1 process × 16 with a mixture (task / buffer / pretraining
    stream), a meta-schedule and loader workers."""
    import torch

    l1, l2, w1, w2 = pair_runs
    assert len(l1) == len(l2) == 9
    for a, b in zip(l1, l2):  # the same global batches: the same losses, rates and split
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["itc"] - b["itc"]) <= 1e-5, (a, b)
        assert a["lr"] == b["lr"] and a["mixture"] == b["mixture"]
    # weights: AdamW turns float rounding in near-zero gradients (the attention key bias, whose
    # true gradient is 0) into steps of up to ~lr; main's own 2-process test (no mixture) ends
    # 8.7e-6 apart here, this one ~1e-5
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=5e-5), k
    # 16 · (0.2, 0.5, 0.3): floors 3 / 8 / 4, 1 left over to pretraining: 4 / 8 / 4; task 0
    # (no buffer items): the buffer's 4 -> 2 to the task, 2 to pretraining
    assert l1[-1]["mixture"] == {"pretrain": 4, "task": 8, "buffer": 4}
    assert l1[0]["mixture"] == {"pretrain": 6, "task": 10, "buffer": 0}


@pytest.mark.slow
@pytest.mark.parametrize("tune", ["lora", "bitfit"])
def test_mixture_with_tune_and_a_flops_budget(tune, tiny, tmp_path):
    """`--tune` and a tflops budget (its probe step runs on the task's first mixed batch):
    every task trains the steps its share buys, from batches holding the split."""
    run = tmp_path / "run"
    argv = train_argv(tiny, run, "lwf") + ["--buffer", "reservoir", "--buffer-size", "8"]
    argv += _mix_args(tiny, True) + ["--tune", tune, "--budget", "tflops=1e-4/task"]
    # a floor: a task the budget buys one step of would train it at lr 0 (refused, issue 47)
    cli(argv + ["--lr-schedule", "cosine-dyn", "--max-steps-per-task", "8", "--min-lr", "1e-5"])
    for t in ("00-t0", "01-t1", "02-t2"):
        tj = json.loads((run / "tasks" / t / "task.json").read_text())
        assert tj["steps"] == tj["budget"]["steps_trained"] >= 1
        assert sum(tj["mixture"]["per_batch"].values()) == 8
