"""What runs cost (cvl.train.cost): counted FLOPs against a hand count and against torch's
FlopCounterMode, counting leaves the training bit-identical, the records in task.json /
run.json / `cvl info`, and the cost columns and plot of `cvl eval --compare`."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from reliability_helpers import comparable
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from train_helpers import FAST, assert_same_task_weights, train_run

from cvl.cli import main
from cvl.runs import finished_tasks
from cvl.train.cost import CostTracker, count_flops, formulas, summarize_run

# A tiny ViT CLIP whose matmuls are easy to count by hand.
E, WV, NV, WT, NT, LT, PATCH, IMG = 32, 48, 2, 40, 3, 16, 8, 32
VIT = {
    "kind": "clip",
    "model_cfg": {
        "embed_dim": E,
        "vision_cfg": {
            "layers": NV,
            "width": WV,
            "head_width": 24,  # 2 heads: even, so eval mode takes MHA's fused fast path
            "patch_size": PATCH,
            "image_size": IMG,
        },
        "text_cfg": {
            "context_length": LT,
            "vocab_size": 256,
            "width": WT,
            "heads": 2,
            "layers": NT,
            "pool_type": "argmax",
        },
    },
    "tokenizer": {"type": "hash", "vocab_size": 256, "context_length": LT},
}


def analytic_step_flops(b: int) -> int:
    """FLOPs of one seqft step (forward + backward, batch b) of VIT, counted by hand.

    A matmul of (m×k)·(k×n) is 2mkn; backward needs two of each (gradients of both inputs),
    except the patch embedding, whose input (the image) needs none. Per transformer layer
    and token of width d: qkv 6d², out projection 2d², MLP (4d) 16d²; attention 2·L·d for
    QKᵀ and 2·L·d for AV per token, and its fused (flash) backward 5 such matmuls (it
    recomputes QKᵀ). Then the two projections to E, and the two logit matrices of the
    symmetric InfoNCE (image·textᵀ and text·imageᵀ over the batch).
    """
    patches, lv = (IMG // PATCH) ** 2, (IMG // PATCH) ** 2 + 1
    conv = 2 * b * patches * (3 * PATCH * PATCH) * WV
    linear = NV * 24 * b * lv * WV**2 + NT * 24 * b * LT * WT**2
    linear += 2 * b * WV * E + 2 * b * WT * E + 2 * (2 * b * b * E)
    attn = NV * 4 * b * lv**2 * WV + NT * 4 * b * LT**2 * WT
    return 2 * conv + 3 * linear + 7 * attn // 2  # conv: forward + weight gradient only


def _raw(f):
    def g(*a, **k):
        return f(*a, **k)

    g._get_raw = True  # already shape-wrapped: FlopCounterMode must not wrap it again
    return g


@pytest.mark.parametrize("config", ["tiny", "tiny-vit", "fusion"])
def test_meter_counts_what_flop_counter_mode_counts(config, tmp_path):
    """The lean meter = torch's FlopCounterMode (with the same CPU-attention formulas) on a
    training step of each packaged model kind (ResNet convolutions, ViT, BERT fusion + MLM)."""
    from cvl.methods.base import TaskContext, base_loss
    from cvl.models import build_model

    torch.manual_seed(0)
    kind, name = ("fusion", "tiny") if config == "fusion" else ("clip", config)
    model = build_model(kind, name)
    img = torch.randn(4, 3, model.image_size, model.image_size)
    txt = model.tokenizer(["a red square", "two blue circles", "a tiny star", "green"])
    ctx = TaskContext(model=model, accelerator=None, config=None, manifest=None, run_dir=None)

    def step():
        ctx.generator = torch.Generator().manual_seed(0)
        out = model(img, txt)
        sum(base_loss(model, {"image": img, "text": txt}, out, ctx).values()).backward()

    n, _ = count_flops(step)
    extra = {k: _raw(v) for k, v in formulas().items() if k not in flop_registry}
    with FlopCounterMode(display=False, custom_mapping=extra) as fc:
        step()
    assert n == fc.get_total_flops() > 0


def test_attention_on_the_cpu_is_counted():
    """torch's registry lacks the CPU's fused attention kernels: without them a transformer
    step would miss its attention FLOPs."""
    q = torch.randn(2, 2, 8, 16, requires_grad=True)
    n, out = count_flops(torch.nn.functional.scaled_dot_product_attention, q, q, q)
    assert n == 4 * 2 * 2 * 8 * 8 * 16  # QKᵀ and AV: 2·(2·b·h·L·L·d)
    m, _ = count_flops(lambda: out.sum().backward())
    assert m == 5 * n // 2


def analytic_forward_flops(b: int) -> int:
    """FLOPs of one forward of VIT (batch b), no loss: the forward halves of
    `analytic_step_flops` (patch convolution, the layers' matmuls, attention, projections)."""
    patches, lv = (IMG // PATCH) ** 2, (IMG // PATCH) ** 2 + 1
    conv = 2 * b * patches * (3 * PATCH * PATCH) * WV
    linear = NV * 24 * b * lv * WV**2 + NT * 24 * b * LT * WT**2
    linear += 2 * b * WV * E + 2 * b * WT * E
    attn = NV * 4 * b * lv**2 * WV + NT * 4 * b * LT**2 * WT
    return conv + linear + attn


class _Ops(TorchDispatchMode):
    """The op packets that run (names)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_frozen_forward_counts_like_a_hand_count(precision, tmp_path):
    """A frozen model's forward (eval mode, no autograd: old, teacher, reference, momentum
    models) = the hand count 2·M·N·K, in float32 — where `nn.MultiheadAttention` takes its
    fused fast path, whose matmuls no dispatch mode sees — and under autocast (unfused path)."""
    from cvl.models import build_model

    torch.manual_seed(0)
    cfg = tmp_path / "vit.json"
    cfg.write_text(json.dumps(VIT))
    model = build_model("clip", str(cfg)).eval()
    b = 3
    img = torch.randn(b, 3, IMG, IMG)
    txt = model.tokenizer(["a red square", "two blue circles", "a tiny star"])
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else None
    with torch.no_grad(), amp or contextlib.nullcontext():
        n, _ = count_flops(model, img, txt)
        with _Ops() as seen:
            model(img, txt)
    fused = "_native_multi_head_attention" in seen.ops
    assert fused == (precision == "fp32")  # the fast path ran where it should (not vacuous)
    assert n == analytic_forward_flops(b)


def test_fused_attention_fast_paths_count_as_the_unfused_path():
    """`aten._native_multi_head_attention` and `aten._transformer_encoder_layer_fwd` (the
    eval-mode fast paths of `nn.MultiheadAttention` and `nn.TransformerEncoderLayer`) count
    what their unfused paths count: the hand count of their matmuls."""
    torch.manual_seed(0)
    e, h, b, n = 16, 4, 2, 5
    mha = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
    layer = torch.nn.TransformerEncoderLayer(e, h, 24, batch_first=True).eval()
    x = torch.randn(b, n, e)
    counts = {}
    with torch.no_grad():
        with _Ops() as seen:
            counts["fused"] = (count_flops(mha, x, x, x)[0], count_flops(layer, x)[0])
        assert {"_native_multi_head_attention", "_transformer_encoder_layer_fwd"} <= seen.ops
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            counts["unfused"] = (count_flops(mha, x, x, x)[0], count_flops(layer, x)[0])
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    attn = 2 * e * (3 * e) * b * n + 4 * b * n * n * e + 2 * e * e * b * n  # in, QKᵀ + AV, out
    want = (attn, attn + 2 * 2 * e * 24 * b * n)  # + the MLP's two matmuls
    assert counts["fused"] == counts["unfused"] == want


def test_seqft_step_flops_match_a_hand_count(synth_stream, tmp_path):
    """The step counted by the training loop (task.json) = the analytic count, within 1 %."""
    cfg = tmp_path / "vit.json"
    cfg.write_text(json.dumps(VIT))
    train_run(synth_stream, tmp_path / "r", FAST, model_config=str(cfg), max_steps_per_task=2)
    for c in finished_tasks(tmp_path / "r"):
        cost = json.loads((c.path / "task.json").read_text())["cost"]
        want = analytic_step_flops(FAST["batch_size"])
        assert abs(cost["flops_per_step"] - want) <= 0.01 * want, (cost["flops_per_step"], want)
        assert cost["step_counted_on"] == "step 1 of the task"
        assert cost["train_flops"] == 2 * cost["flops_per_step"] and cost["samples"] == 32


class _Uncounted(CostTracker):
    def __init__(self, device, enabled=True):
        super().__init__(device, enabled=False)


@pytest.mark.parametrize("method", ["seqft", "afec", "ctp", "incclip", "lwf"])
def test_a_counted_run_trains_bit_for_bit_like_an_uncounted_one(
    method, synth_stream, tmp_path, monkeypatch
):
    """Counting dispatches every op of the counted step (and of the extras) through Python:
    the same kernels on the same inputs, so the same weights and losses to the bit."""
    kw = dict(FAST, max_steps_per_task=3, method=method)
    if method == "incclip":
        kw.update(buffer="reservoir", buffer_size=16, method_args={"n_pseudo": 8, "gen_steps": 2})
    train_run(synth_stream, tmp_path / "counted", kw)
    monkeypatch.setattr("cvl.train.loop.CostTracker", _Uncounted)
    train_run(synth_stream, tmp_path / "plain", kw)
    assert_same_task_weights(tmp_path / "counted", tmp_path / "plain")
    for a, b in zip(finished_tasks(tmp_path / "counted"), finished_tasks(tmp_path / "plain")):
        la, lb = (c.path / "train_log.jsonl" for c in (a, b))
        drop = ("samples_per_s",)
        ra = [{k: v for k, v in json.loads(x).items() if k not in drop} for x in la.open()]
        rb = [{k: v for k, v in json.loads(x).items() if k not in drop} for x in lb.open()]
        assert ra == rb
        ca = json.loads((a.path / "task.json").read_text())["cost"]
        cb = json.loads((b.path / "task.json").read_text())["cost"]
        assert ca["flops_per_step"] > 0 and cb["flops_per_step"] is None


def test_cost_records_extras_run_totals_and_info(synth_stream, tmp_path, capsys):
    """EWC: its Fisher pass is an extra of tasks 0 and 1 (none after the last task), counted
    as about one forward + backward per batch of the task; run.json sums the tasks; `cvl
    info` shows both."""
    out = tmp_path / "ewc"
    train_run(synth_stream, out, FAST, method="ewc", max_steps_per_task=2)
    tasks = [json.loads((c.path / "task.json").read_text()) for c in finished_tasks(out)]
    step = tasks[0]["cost"]["flops_per_step"]
    for i, t in enumerate(tasks):
        c = t["cost"]
        assert c["steps"] == 2 and c["train_flops"] == 2 * c["flops_per_step"]
        fisher = c["extras"].get("after_task", {}).get("flops", 0)
        if i < 2:  # 96 pairs / 16 = 6 batches, each a forward + backward of the base loss
            assert 5.5 * step < fisher < 6.5 * step
        else:
            assert fisher == 0
        assert c["total_flops"] == c["train_flops"] + c["extra_flops"]
        assert c["peak_memory_bytes"] > 0 and c["wall_s"] > 0 and c["processes"] == 1
    run = json.loads((out / "run.json").read_text())["cost"]
    assert run == summarize_run(out)
    assert run["total_flops"] == sum(t["cost"]["total_flops"] for t in tasks)
    assert run["samples"] == 3 * 2 * FAST["batch_size"]
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "00-t0 cost: " in text and "cost of the 3 task(s): " in text


def test_resumed_task_keeps_its_counted_step(synth_stream, tmp_path, monkeypatch):
    """A task interrupted after its counted step keeps that count (from last/) and does not
    count again; the records equal an uninterrupted run's (measured fields aside)."""
    from train_helpers import interrupt_then_resume

    from cvl.methods.seqft import SeqFT

    kw = dict(FAST, checkpoint_every=1)
    train_run(synth_stream, tmp_path / "whole", kw)
    starts = []
    real = CostTracker.start_step

    def spy(self, source="x"):
        starts.append(source)
        real(self, source)

    monkeypatch.setattr(CostTracker, "start_step", spy)
    interrupt_then_resume(
        lambda o: train_run(synth_stream, o, kw), SeqFT, tmp_path / "cut", monkeypatch
    )
    assert starts == ["step 1 of the task"] * 3  # tasks 0, 1 (before the cut) and 2
    for a, b in zip(finished_tasks(tmp_path / "whole"), finished_tasks(tmp_path / "cut")):
        ta = comparable(json.loads((a.path / "task.json").read_text()))
        tb = comparable(json.loads((b.path / "task.json").read_text()))
        assert ta == tb


def test_compare_has_cost_columns_and_a_compute_plot(synth_stream, tmp_path):
    """`write_compare`: total TFLOPs, peak memory and device-hours of each run (from its
    task.json files), '–' for a run trained before cost was recorded, and Rm against compute."""
    from cvl.evaluation.comparison import compare_table, write_compare

    train_run(synth_stream, tmp_path / "a", FAST, max_steps_per_task=1)
    train_run(synth_stream, tmp_path / "b", FAST, method="lwf", max_steps_per_task=1)
    ms = []
    for name in ("a", "b", "old"):
        ms.append(
            {
                "run": str(tmp_path / name),
                "run_name": name,
                "method_label": name,
                "tasks": ["t0", "t1", "t2"],
                "rows": [],
                "matrices": {},
                "final": {},
                "continual": {"Rm": {"average_final": 40.0 + len(ms)}},
            }
        )
    headers, rows = compare_table(ms)
    col = {h: i for i, h in enumerate(headers)}
    tf = [r[col["TFLOPs"]] for r in rows]
    want = summarize_run(tmp_path / "a")["total_flops"] / 1e12
    assert tf[0] == f"{want:.3g}" and float(tf[1]) > float(tf[0]) and tf[2] == "–"
    assert rows[0][col["peak mem (GB)"]] != "–" and rows[0][col["device-hours"]] != "–"
    files = write_compare(ms, tmp_path / "cmp")
    assert tmp_path / "cmp" / "compare_Rm_vs_compute.png" in files
    j = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert j["runs"][0]["TFLOPs"] == pytest.approx(want) and j["runs"][2]["TFLOPs"] is None


def test_tracker_counts_an_extra_once_per_task_across_sessions():
    """The first call of an extra is counted, later ones take its count (also after a resume
    from a checkpoint's state); the step counted in one session is carried to the next."""
    dev = torch.device("cpu")
    a = torch.randn(8, 8)
    t = CostTracker(dev)
    t.begin_task()
    with t.extra("fisher"):
        a @ a
    t.start_step()
    a @ a @ a
    t.stop_step()
    saved = t.state()
    assert saved["flops_per_step"] == 2 * 2 * 8**3
    assert saved["extras"] == {"fisher": {"flops_per_call": 2 * 8**3, "calls": 1}}
    t2 = CostTracker(dev)  # the resumed session
    t2.begin_task(saved)
    assert t2.has_step
    with t2.extra("fisher"):
        a @ a @ a @ a  # a later call: not counted, taken to cost the first one's
    with t2.extra("before_task", skip=True):
        a @ a  # redone on resume: neither counted nor called again
    rec = t2.task_record(steps=5, samples_per_step=8, processes=1)
    assert rec["extras"] == {"fisher": {"flops_per_call": 1024, "calls": 2, "flops": 2048}}
    assert rec["train_flops"] == 5 * 2048 and rec["total_flops"] == 5 * 2048 + 2048


def test_compare_reads_the_cost_of_a_moved_run(synth_stream, tmp_path, capsys):
    """`cvl eval --compare` with a cached evaluation of a run folder that was moved since:
    the cost columns come from the folder as named now."""
    train_run(synth_stream, tmp_path / "a", FAST, max_steps_per_task=1)
    quiet = ["--quiet", "--no-probe", "--no-zeroshot", "--no-plots"]
    assert main(["eval", "--run", str(tmp_path / "a"), *quiet]) == 0
    (tmp_path / "a").rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["eval", "--compare", str(tmp_path / "moved"), *quiet]) == 0
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| a |")][
        0
    ]  # its cached name
    want = summarize_run(tmp_path / "moved")["total_flops"] / 1e12
    assert f"| {want:.3g} |" in row
