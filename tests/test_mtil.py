"""MTIL / X-TAIL: Transfer / Avg. / Last on hand-made matrices (and ZSCL's own numbers), the
class-text cross-entropy on hand-computable tensors, --base-loss class-ce in the training loop
(fixed steps per task, per-task lr, 2 processes = 1, bitwise resume), and `cvl eval`'s tables."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from train_helpers import FAST, assert_same_task_weights, interrupt_then_resume, task_log, train_run

from cvl.errors import CvlError
from cvl.evaluation import mtil
from cvl.losses import class_text_ce

# -- Transfer / Avg. / Last -----------------------------------------------------------------

R3 = [
    [80.0, 30.0, 10.0],  # after task 0
    [70.0, 90.0, 20.0],  # after task 1
    [60.0, 85.0, 95.0],  # after task 2
]


def test_transfer_avg_last_by_hand():
    """Transfer_j = mean of the rows before j (task 0 has none and is left out of the mean),
    Avg_j = column mean over all rows, Last = the last row."""
    s = mtil.summary(R3)
    assert s["per_task"]["transfer"] == [None, 30.0, 15.0]  # (10 + 20) / 2
    assert s["transfer"] == pytest.approx(22.5)  # (30 + 15) / 2, not / 3
    assert s["per_task"]["avg"] == pytest.approx([70.0, 205 / 3, 125 / 3])
    assert s["avg"] == pytest.approx(sum(map(sum, R3)) / 9)  # the whole matrix's mean
    assert s["per_task"]["last"] == [60.0, 85.0, 95.0]
    assert s["last"] == pytest.approx(80.0)


def test_first_task_alone_and_zeros_count():
    one = mtil.summary([[42.0]])
    assert one["transfer"] is None and one["avg"] == one["last"] == 42.0
    z = mtil.summary([[50.0, 0.0], [50.0, 0.0]])
    assert z["transfer"] == 0.0  # a true 0 % counts (RAIL's masked_equal(0) would drop it)
    with pytest.raises(ValueError, match="square"):
        mtil.summary([[1.0, 2.0]])


def test_zscl_notebook_zero_shot_numbers():
    """ZSCL's results.ipynb: the zero-shot row (CIFAR-10 deleted) repeated 11 times gives
    Transfer 69.4, Avg. 65.3, Last 65.3 in order I and 65.4 / 65.3 / 65.3 in order II."""
    zs = [24.3, 88.4, 68.2, 44.6, 54.9, 71.0, 88.5, 59.4, 89.0, 64.7, 65.2]
    s = mtil.summary([zs] * 11)
    assert [round(s[k], 1) for k in ("transfer", "avg", "last")] == [69.4, 65.3, 65.3]
    order2 = [zs[i] for i in (9, 6, 7, 8, 5, 10, 0, 1, 3, 4, 2)]
    s2 = mtil.summary([order2] * 11)
    # the notebook prints 65.4: numpy's mean gives 65.35000000000001, rounded up
    assert s2["transfer"] == pytest.approx(65.35) and round(s2["avg"], 1) == 65.3


def test_block_needs_the_full_matrix_and_names_both_protocols():
    mats = {"ZS-top1": R3, "ZS-all-top1": [[v / 2 for v in r] for r in R3]}
    b = mtil.block(mats, ["a", "b", "c"], 3)
    assert b["mtil"]["transfer"] == pytest.approx(22.5)
    assert b["xtail"]["transfer"] == pytest.approx(11.25) and b["xtail"]["metric"] == "ZS-all-top1"
    assert mtil.block(mats, ["a", "b", "c"], 2) == {}  # a partial run: no MTIL numbers
    assert mtil.block({"ZS-top1": [[1.0, None], [1.0, 1.0]]}, ["a", "b"], 2) == {}
    cols = mtil.compare_columns([{"mtil": b}])
    assert cols[0] == ("MTIL Transfer", "mtil", "transfer") and len(cols) == 6


# -- the class-text cross-entropy -------------------------------------------------------------


def _lse(z):
    return math.log(sum(math.exp(v) for v in z))


def test_class_text_ce_by_hand():
    """logits = s·v·Wᵀ over every class; per row logZ − (1−ε)·z_y − ε·mean(z); rows with label
    -1 (another task's items) are left out of the mean."""
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    y = torch.tensor([0, 2, -1])
    got = class_text_ce(v, w, y, scale=2.0, smoothing=0.2)
    r0 = _lse([2, 0, -2]) - (0.8 * 2 + 0.2 * 0)  # z = (2, 0, -2), y = 0
    r1 = _lse([0, 2, 0]) - (0.8 * 0 + 0.2 * 2 / 3)  # z = (0, 2, 0), y = 2
    assert float(got) == pytest.approx((r0 + r1) / 2, rel=1e-6)
    assert float(class_text_ce(v[:1], w, y[:1], 2.0, 0.0)) == pytest.approx(_lse([2, 0, -2]) - 2)


def _ctx(tasks, **cfg):
    """A TaskContext for base_terms: a stream with `tasks` {name: (categories, templates)}, a
    model set by the test."""
    from cvl.methods.base import TaskContext
    from cvl.streams.manifest import Manifest, ShardSet, TaskInfo

    infos = {
        t: TaskInfo(t, ShardSet(["x.tar"], 1), categories=c, extra={"templates": tm})
        for t, (c, tm) in tasks.items()
    }
    m = Manifest("s", "classification", "", 0, list(tasks), infos)
    cats = [c for cs, _ in tasks.values() for c in cs or []]
    m.class_map = {
        "names": cats,
        "prompts": [c.split("/")[1] for c in cats],
        "task_of": ["d"] * len(cats),
    }
    config = SimpleNamespace(base_loss="class-ce", base_loss_args=cfg)
    return TaskContext(None, None, config, m, run_dir=None, task_name="d")


class _TextModel(torch.nn.Module):
    """encode_text: prompt -> a fixed vector from `table` (the prompts seen are recorded)."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.table, self.seen, self.vocab = table, [], []

    def tokenizer(self, prompts):
        self.vocab += [p for p in prompts if p not in self.vocab]
        return torch.tensor([self.vocab.index(p) for p in prompts])

    def encode_text(self, tok):
        prompts = [self.vocab[i] for i in tok.tolist()]
        self.seen.append(prompts)
        return torch.tensor([self.table[p] for p in prompts]) + 0 * self.w


def test_base_terms_class_ce_defaults_are_the_zscl_codes():
    """--base-loss class-ce: every class of the current task (not only the batch's), its first
    template, the model's logit scale (100 for OpenAI's CLIP) and label smoothing 0.2 (ZSCL's
    scripts); cos = ±0.01 gives the hand value of scale 1 at scale 100. A wrong scale,
    smoothing or class set fails."""
    from cvl.methods.base import base_terms

    ctx = _ctx({"d": (["d/x", "d/y", "d/z"], ["a {}", "the {}"])})
    ctx.model = _TextModel({"a x": [0.01, 0.0], "a y": [0.0, 0.0], "a z": [-0.01, 0.0]})
    out = {"image_features": torch.tensor([[1.0, 0.0], [1.0, 0.0]])}
    out["logit_scale"] = torch.tensor(100.0, requires_grad=True)  # OpenAI CLIP's exp(4.6052)
    batch = {"category": ["d/x", "d/x"]}  # the batch holds class x only
    t = base_terms(batch, out, ctx)
    assert list(t) == ["class_ce"] and ctx.model.seen == [["a x", "a y", "a z"]]
    want = _lse([1, 0, -1]) - (0.8 * 1 + 0.2 * 0)  # 0.6076...
    assert float(t["class_ce"].detach()) == pytest.approx(want, rel=1e-5)
    out["logit_scale"] = torch.tensor(50.0)  # the model's scale is the default ...
    half = _lse([0.5, 0, -0.5]) - (0.8 * 0.5 + 0.2 * 0)
    assert float(base_terms(batch, out, ctx)["class_ce"].detach()) == pytest.approx(half, rel=1e-5)
    ctx.config.base_loss_args = {"scale": 100}  # ... unless fixed
    assert float(base_terms(batch, out, ctx)["class_ce"].detach()) == pytest.approx(want, rel=1e-5)
    ctx.config.base_loss_args = {"smoothing": 0.0, "template": 1, "scale": 100}
    ctx.model.table.update({"the x": [0.01, 0.0], "the y": [0.0, 0.0], "the z": [-0.01, 0.0]})
    assert float(base_terms(batch, out, ctx)["class_ce"].detach()) == pytest.approx(
        _lse([1, 0, -1]) - 1
    )
    assert ctx.model.seen[-1] == ["the x", "the y", "the z"]
    ctx.config.base_loss = "itc"
    out.update(text_features=out["image_features"])
    assert list(base_terms(batch, out, ctx)) == ["itc"]


def test_base_loss_arguments_are_checked():
    from cvl.methods.base import resolve_base_loss_args

    assert resolve_base_loss_args("class-ce", {"scale": "50"})["scale"] == 50.0
    with pytest.raises(CvlError, match="no argument 'temp'"):
        resolve_base_loss_args("class-ce", {"temp": 1})
    with pytest.raises(CvlError, match=r"smoothing must be in \[0, 1\)"):
        resolve_base_loss_args("class-ce", {"smoothing": 1.5})
    with pytest.raises(CvlError, match="scale must be > 0"):
        resolve_base_loss_args("class-ce", {"scale": -1})
    with pytest.raises(CvlError, match="--base-loss must be one of itc, class-ce"):
        resolve_base_loss_args("ce", {})
    from cvl.classtext import task_label_space

    ctx = _ctx({"d": (None, None)})
    with pytest.raises(CvlError, match="lists no classes"):
        task_label_space(ctx.manifest, "d")


# -- training ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cls_stream(tmp_path_factory):
    """3 synthetic datasets (4 shapes each, 8 train / 4 test per class) as a classification
    stream built from image folders, and its pretraining stream."""
    from cvl.streams.classification import build_classification
    from cvl.streams.pipeline import BuildOptions
    from cvl.streams.synthetic_folders import build_synthetic_folders

    root = tmp_path_factory.mktemp("mtil")
    names = build_synthetic_folders(root / "data", 3, 4, 8, 4, pretrain=64, seed=0)
    opts = BuildOptions(out=root / "s", progress=False, log=lambda m: None)
    build_classification(root / "data", names, opts, templates="synthetic")
    return root / "s"


def test_steps_per_task_and_task_lr(cls_stream, tmp_path):
    """--steps-per-task 5 with 2 batches per epoch: 5 steps over 3 epochs on every task; the
    schedule spans the 5 steps; --task-lr gives one task its own peak rate; the logit scale is
    not trained (the ZSCL code leaves it out of its optimizer)."""
    kw = dict(FAST, base_loss="class-ce", steps_per_task=5, batch_size=16, lr=1e-3)
    train_run(cls_stream, tmp_path / "r", kw, task_lr={"synth1": 1e-2}, method="seqft")
    for i in range(3):
        log = task_log(tmp_path / "r", i)
        assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
        assert [r["epoch"] for r in log] == [0, 0, 1, 1, 2]
        assert "class_ce" in log[0] and "itc" not in log[0]
        peak = 1e-2 if i == 1 else 1e-3
        assert log[0]["lr"] == pytest.approx(peak)  # no warm-up: step 1 at the peak
    from safetensors.torch import load_file

    w0 = load_file(str(tmp_path / "r" / "init" / "model.safetensors"))
    w3 = load_file(str(tmp_path / "r" / "tasks" / "02-synth2" / "model.safetensors"))
    assert torch.equal(w0["clip.logit_scale"], w3["clip.logit_scale"])
    assert not torch.equal(w0["clip.ln_final.weight"], w3["clip.ln_final.weight"])
    with pytest.raises(CvlError, match="--task-lr nope: stream .* has no such task"):
        train_run(cls_stream, tmp_path / "bad", kw, task_lr={"nope": 1e-3})
    with pytest.raises(CvlError, match="method 'ctp' trains with its own contrastive"):
        train_run(cls_stream, tmp_path / "ctp", kw, method="ctp")


def test_class_ce_resume_is_bitwise(cls_stream, tmp_path, monkeypatch):
    """LwF with class-ce (its distillation on top of the class-text cross-entropy), stopped in
    task 2's second pass over its data (--steps-per-task) and resumed, saves the same bits as
    an uninterrupted run."""
    from cvl.methods.lwf import LwF

    kw = dict(FAST, base_loss="class-ce", steps_per_task=6, batch_size=8, checkpoint_every=1)
    kw.update(method="lwf", model_config="tiny-vit")  # 4 batches per epoch: 6 steps = 1.5 epochs
    train_run(cls_stream, tmp_path / "whole", kw)
    pos = interrupt_then_resume(
        lambda out: train_run(cls_stream, out, kw), LwF, tmp_path / "cut", monkeypatch, step=5
    )
    assert (pos["step"], pos["epoch"], pos["batch"]) == (4, 1, 0)  # resumed in the 2nd epoch
    assert_same_task_weights(tmp_path / "whole", tmp_path / "cut")
    assert "lwf_kd" in task_log(tmp_path / "whole", 1)[0]


def _class_ce_pair(method: str):
    """The 2 × 8 = 1 × 16 run of `method` with class-ce (test_distributed's torchrun_pair
    form). Adam ε 1e-3 ({eps}, as test_distributed's EPS_1E3): the text tower's attention key
    biases get only rounding noise as gradient (exactly 0 in exact arithmetic), which Adam at
    ε 1e-6 turns into ±lr updates that differ between 1 × 16 and 2 × 8 rows."""
    extra = ["--method", method, "--base-loss", "class-ce", "--steps-per-task", "3"]
    extra += ["--config", "{eps}"]
    if method == "icarl":  # as recipes/mtil.sh runs it (similarity-logit distillation)
        extra += ["--buffer", "mof", "--buffer-size", "8", "--method-arg", "variant=logits"]
    return pytest.mark.torchrun_pair(*extra).mark


CLASS_CE_PAIRS = {m: _class_ce_pair(m) for m in ("seqft", "icarl")}


@pytest.fixture(scope="module")
def class_ce_runs(cls_stream, tmp_path_factory):
    """Both methods' 2-process runs in one torchrun launch (test_distributed.launch_pairs)."""
    from test_distributed import launch_pairs, pair_key

    marks = {pair_key(m): m for m in CLASS_CE_PAIRS.values()}
    return launch_pairs(cls_stream, tmp_path_factory.mktemp("pairs"), marks)


@pytest.mark.slow
@pytest.mark.xdist_group("mtil_class_ce")  # one worker launches class_ce_runs
@pytest.mark.parametrize("method", ["seqft", "icarl"])
def test_class_ce_two_processes_equal_one(method, cls_stream, class_ce_runs, tmp_path):
    """2 processes x batch 8 = 1 x 16 with class-ce (each rank embeds the same class texts;
    the masked mean over the global batch), 3 steps per task over 2 epochs; iCaRL mixes its
    herding buffer's items of earlier tasks into the batches, which the cross-entropy leaves
    out (rank by rank, counted over the global batch)."""
    from test_distributed import WEIGHT_ATOL, assert_weights_close, pair_of

    l1, l2, w1, w2 = pair_of(class_ce_runs, CLASS_CE_PAIRS[method], cls_stream, tmp_path)
    assert len(l1) == len(l2) == 9 and [r["epoch"] for r in l1[:3]] == [0, 0, 1]
    tol = 5e-5 if method == "icarl" else 1e-5  # relative for the KD, as test_distributed
    for a, b in zip(l1, l2):
        for k in ("class_ce", "icarl_kd"):
            if k in a:
                assert abs(a[k] - b[k]) <= tol * max(1.0, abs(a[k])), (k, a, b)
    assert method == "seqft" or "icarl_kd" in l1[-1]
    # key biases: zero gradient in exact arithmetic, Adam-normalised rounding (test_distributed)
    assert_weights_close(w1, w2, atol=WEIGHT_ATOL)


def test_eval_reports_mtil_and_x_tail(cls_stream, tmp_path):
    """`cvl eval`: ZS-top1 with each task's template ensemble, ZS-all-top1 over all 12
    classes; metrics.json's mtil block = the formulas on its matrices; summary.md and
    --compare carry the Transfer / Avg. / Last columns."""
    from cvl.evaluation.comparison import compare_records
    from cvl.evaluation.options import EvalOptions
    from cvl.evaluation.runner import evaluate_run

    train_run(cls_stream, tmp_path / "r", dict(FAST, base_loss="class-ce", steps_per_task=2))
    m = evaluate_run(tmp_path / "r", EvalOptions(probe=False, progress=False))
    assert m["protocol"]["zs_templates"].startswith("each task's own ensemble")
    details = m["details"]["00-synth0"]["synth1"]
    assert details["zeroshot"]["n_classes"] == 4 and details["zeroshot_all"]["n_classes"] == 12
    b = m["mtil"]
    assert b["mtil"]["transfer"] == pytest.approx(
        mtil.summary(m["matrices"]["ZS-top1"])["transfer"]
    )
    assert b["xtail"]["last"] == pytest.approx(mtil.summary(m["matrices"]["ZS-all-top1"])["last"])
    headers, recs = compare_records([m])
    assert "MTIL Transfer" in headers and "X-TAIL Last" in headers
    assert recs[0]["MTIL Avg."] == pytest.approx(b["mtil"]["avg"])
    from cvl.evaluation.report import render_markdown

    md = render_markdown(m)
    assert "MTIL (ZSCL Table 1)" in md and "X-TAIL (RAIL)" in md and "| Transfer | – |" in md
    json.dumps(m)  # JSON-able
