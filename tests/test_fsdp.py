"""`cvl train --fsdp` (cvl/train/fsdp.py): the plan, the refusals, the sharded arithmetic,
and every method under FSDP2 on 2 processes against today's mode.

Default suite (cheap): the plan and the refusals in this process; one 2-process `--fsdp`
run (LwF: a sharded frozen teacher) in the shared torchrun launch (`torchrun_pair`) against
the 1-process run at the 2-process tolerances of tests/test_distributed.py, entered after
checking every sharded operator against the whole-tensor one on its 2 processes
(tests/fsdp_helpers.py: `sharded_ops_checked`).

`matrix` (make matrix): every registered method under --fsdp against the same method without
it, both on 2 processes, and four settings (activation checkpointing, gradient accumulation,
the fusion model, a freezing --tune mode) likewise, in ONE torchrun launch; and for one
method per kind of mid-task state, a run that dies right after a mid-task checkpoint resumed
by the same command, bit for bit equal to the uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch
from reliability_helpers import assert_same_run
from safetensors.torch import load_file
from test_distributed import (
    ADAM_NOISE,
    HERE,
    KEY_BIAS_ATOL,
    MAGNITUDE_SELECTING,
    TOL,
    WEIGHT_ATOL,
    _all_logs,
    _argv,
    _context,
    _one_process,
    _pair_extra,
    _torchrun,
    assert_close_but_for_flips,
    pair_key,
)
from test_method_dha import assert_weights_close

from cvl.errors import CvlError
from cvl.methods.registry import all_methods, get_method
from cvl.runs import finished_tasks
from cvl.train import fsdp

# -- the plan, the refusals (this process) -------------------------------------------------------


def test_plan_shards_blocks_and_towers_and_keeps_tied_weights_together():
    from cvl.models import build_model

    clip = build_model("clip", "tiny-vit")
    names = [n for n, _, _ in fsdp.shard_units(clip)]
    blocks = [n for n in names if ".resblocks." in n]
    assert len(blocks) == len(clip.clip.visual.transformer.resblocks) + len(
        clip.clip.transformer.resblocks
    )
    assert names[len(blocks) :] == ["clip.visual", "clip.token_embedding"]
    assert dict((n, m) for n, _, m in fsdp.shard_units(clip))["clip.visual"] == ("forward",)
    fusion = build_model("fusion", "tiny")
    units = dict((n, u) for n, u, _ in fsdp.shard_units(fusion))
    vit = [n for n in units if n.startswith("visual_encoder.blocks.")]
    bert = [n for n in units if n.startswith("text_encoder.bert.encoder.layer.")]
    assert len(vit) == len(fusion.visual_encoder.blocks)
    assert len(bert) == fusion.text_layers + fusion.fusion_layers
    assert "visual_encoder" in units
    # the MLM decoder is tied to the word embeddings: neither is a unit of its own (one
    # group holds both: the model's), and the checkpoint drops the decoder's name
    word = fusion.text_encoder.bert.embeddings.word_embeddings.weight
    assert not any(any(p is word for p in u.parameters()) for u in units.values())
    from cvl.models.tune import dedupe_shared

    assert fsdp.tied_names(fusion) == dedupe_shared(fusion.state_dict())[1] != {}


def _cfg(**kw) -> types.SimpleNamespace:
    base = {"fsdp": True, "precision": "no", "compile": False, "tune": "full"}
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"precision": "fp16"}, "--precision bf16"),
        ({"compile": True}, "--compile"),
        ({"tune": "lora"}, "--tune lora"),
        ({"budget": "tflops=2/task"}, "--budget samples=N"),
    ],
)
def test_settings_fsdp_does_not_train_with_are_one_line(setting, says):
    with pytest.raises(CvlError) as e:
        fsdp.check_config(_cfg(**setting))
    assert says in str(e.value) and "\n" not in str(e.value)
    fsdp.check_config(_cfg(tune="bitfit"))  # a mode that only freezes parameters trains
    fsdp.check_config(_cfg(budget="samples=64/task"))
    fsdp.check_config(_cfg(fsdp=False, precision="fp16"))


def test_methods_without_fsdp_are_refused_by_name_and_listed():
    from click.testing import CliRunner

    from cvl.cli import cli

    lucir = get_method("lucir")({})
    with pytest.raises(CvlError, match="method 'lucir' under --fsdp: its cosine-normalised"):
        fsdp.check_method(lucir)
    wise = get_method("wise")({"base": "lucir"})  # a wrapper is refused for its base
    assert "cosine-normalised" in str(fsdp.method_support(wise))
    assert "--tune lora" in str(fsdp.method_support(get_method("cclip")))
    refused = {n for n, c in all_methods().items() if fsdp.method_support(c) is not True}
    assert refused == {"lucir", "cclip", "lora_per_task"}
    out = CliRunner().invoke(cli, ["methods"]).output
    assert out.count("--fsdp: not supported") == len(refused)


def test_an_accelerate_fsdp_config_points_to_the_flag(monkeypatch, tmp_path):
    """Accelerate's own FSDP would wrap nothing cvl runs (cvl never hands it the model):
    refused in one line naming `--fsdp`."""
    import cvl.device
    from cvl.train.config import resolve
    from cvl.train.loop import Trainer

    fake = types.SimpleNamespace(distributed_type="FSDP")
    monkeypatch.setattr(cvl.device, "accelerator", lambda *a, **k: fake)
    cfg = resolve(None, {"stream": str(tmp_path / "s"), "out": str(tmp_path / "r")})
    with pytest.raises(CvlError, match="accelerate config selects FSDP.*cvl train --fsdp"):
        Trainer(cfg, progress=False)


def test_a_mid_task_checkpoint_resumes_only_with_its_process_count(tmp_path):
    """last/ counts its task's global batches (--batch-size × processes): a resume under
    another count is one line saying what to do (the files would allow it)."""
    from fsdp_helpers import Crash, crash_after_checkpoint
    from reliability_helpers import build_tiny_stream, cli, train_argv

    stream = build_tiny_stream(tmp_path / "s")
    argv = [*train_argv(stream, tmp_path / "run", "seqft"), "--max-steps-per-task", "2"]
    with crash_after_checkpoint(), pytest.raises(Crash):
        cli(argv)
    pos = tmp_path / "run" / "last" / "position.json"
    d = json.loads(pos.read_text())
    assert d["processes"] == 1
    pos.write_text(json.dumps({**d, "processes": 2}))
    from cvl.train.cli import train

    with pytest.raises(CvlError, match="written by 2 processes .* resume it with 2 processes"):
        train.main(args=argv[1:], standalone_mode=False)


def test_global_kthvalue_is_torch_kthvalue_in_one_process():
    from cvl.methods.merge_dist import global_kthvalue

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        ts = [torch.randn(5, 7, generator=g).abs().to(dtype), torch.zeros(3, dtype=dtype)]
        ts.append(torch.tensor(0.5, dtype=dtype))
        ts[0][0, :3] = 0.25  # ties
        flat = torch.cat([t.flatten() for t in ts])
        for k in (1, 2, 4, 20, flat.numel()):
            assert torch.equal(global_kthvalue(ts, k), flat.kthvalue(k).values), (dtype, k)


# -- 2 processes, in the shared launch (make test) ------------------------------------------------


def _fsdp_pair(request, torchrun_batch, synth_stream, tmp_path):
    """(1-process logs, 2-process --fsdp logs, their final weights): the 2-process run from
    the shared launch, the 1-process run here without --fsdp (today's mode)."""
    mark = request.node.get_closest_marker("torchrun_pair")
    folder, result, err = torchrun_batch[pair_key(mark)]
    assert result == 0, f"torchrun run of {mark.args}: {result} {err}"
    shutil.copytree(folder / "two", tmp_path / "two")
    extra = [a for a in _pair_extra(mark, synth_stream, folder.parent) if a != "--fsdp"]
    return _one_process(synth_stream, extra, tmp_path, _context(mark.kwargs.get("context")))


@pytest.mark.slow
@pytest.mark.torchrun_pair("--method", "lwf", "--fsdp", context="fsdp_helpers:sharded_ops_checked")
def test_fsdp_lwf_on_two_processes_equals_one(request, torchrun_batch, synth_stream, tmp_path):
    """The previous-task model sharded like the student (forward only), the student's
    gradients reduce-scattered; the launch first checks the sharded operators."""
    l1, l2, w1, w2 = _fsdp_pair(request, torchrun_batch, synth_stream, tmp_path)
    assert any(r["task_index"] == 1 and "lwf_kd" in r for r in l2)
    for a, b in zip(l1, l2):
        for k in ("loss", "itc", "lwf_kd"):
            if k in a:
                assert abs(a[k] - b[k]) <= TOL["lwf"] * max(1.0, abs(a[k])), (k, a, b)
    assert len(l1) == len(l2)
    assert_close_but_for_flips(w1, w2)


# -- every method (make matrix) -------------------------------------------------------------------

#: one method per kind of sharded state a mid-task checkpoint must hold: per-parameter
#: importance and anchors (ewc); a sharded copy of the model with its own optimizer (afec)
#: (CTP's momentum model and queues also resumed bit for bit when measured, 2026-11-28)
RESUMED = ("ewc", "afec")
#: settings that change how a sharded step runs, each with a method that exercises it
SETTINGS = {
    "grad-checkpointing": ("lwf", "--grad-checkpointing"),
    "grad-accum": ("ewc", "--grad-accum", "2"),
    # the fusion model: ViT and BERT blocks, the MLM decoder tied to the word embeddings
    "fusion": ("ctp", "--model", "fusion", "--model-config", "tiny"),
    # a tuning mode that freezes parameters: the merge's weights (θ_0 from a copy) are the
    # trained ones only
    "bitfit": ("ties", "--tune", "bitfit"),
}


def _stream(root: Path) -> Path:
    """2 tasks × 32 pairs (the second task has the previous model, importance, merges)."""
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    spec = SynthSpec(tasks=2, per_task=32, test_per_task=8, val_per_task=4, query_per_task=4,
                     gallery_per_task=8, overlap=0, seed=0)  # fmt: skip
    build_synthetic(root / "s", spec, progress=False)
    return root / "s"


def _supported() -> list[str]:
    from reliability_helpers import trained_methods

    return [m for m in trained_methods() if fsdp.method_support(all_methods()[m]) is True]


def _selected(request, test, param: str = "method") -> list[str]:
    """The `param` values of the selected items of `test` (a -k selection launches only
    what it checks)."""
    return [
        i.callspec.params[param]
        for i in request.session.items
        if getattr(i, "originalname", None) == test.__name__ and hasattr(i, "callspec")
    ]


@pytest.fixture(scope="module")
def fsdp_runs(request, tmp_path_factory):
    """ONE torchrun launch: every supported method without and with --fsdp; the RESUMED
    methods' runs with a checkpoint per step, uninterrupted and killed after task 2's first
    checkpoint then resumed (tests/fsdp_helpers.py: crash_after_checkpoint)."""
    root = tmp_path_factory.mktemp("fsdp")
    stream = _stream(root)
    cmds: dict = {}
    for m in _selected(request, test_every_method_under_fsdp_equals_it_without):
        cmds[f"ddp/{m}"] = _argv(stream, root / "ddp" / m, m, 8)
        cmds[f"fsdp/{m}"] = [*_argv(stream, root / "fsdp" / m, m, 8), "--fsdp"]
    for s in _selected(request, test_settings_under_fsdp_equal_them_without, "setting"):
        method, *extra = SETTINGS[s]
        for mode, more in (("ddp", []), ("fsdp", ["--fsdp"])):
            argv = _argv(stream, root / f"{mode}-{s}" / method, method, 8)
            cmds[f"{mode}-{s}"] = [*argv, *extra, *more]
    for m in _selected(request, test_fsdp_run_resumed_after_a_crash_is_bitwise_the_same):
        argv = [*_argv(stream, root / "ref" / m, m, 8), "--fsdp"]
        ref = [*argv, "--checkpoint-every", "1"]  # 2 steps a task: the crash after step 1
        cmds[f"ref/{m}"] = ref
        run = [a if a != str(root / "ref" / m) else str(root / "crash" / m) for a in ref]
        cmds[f"crash/{m}"] = {"argv": run, "context": "fsdp_helpers:crash_after_checkpoint"}
        cmds[f"resume/{m}"] = run
    (root / "cmds.json").write_text(json.dumps(cmds))
    r = _torchrun([str(HERE / "dist_many.py"), str(root / "cmds.json"), str(root / "res.json")])
    res = json.loads((root / "res.json").read_text()) if r.returncode == 0 else {}
    return root, res, r.stderr[-3000:]


@pytest.mark.matrix
@pytest.mark.xdist_group("fsdp_runs")
@pytest.mark.parametrize("method", _supported())
def test_every_method_under_fsdp_equals_it_without(method, fsdp_runs):
    """Per-step losses within test_distributed's 2-process tolerances (measured 2026-11-28,
    2-core CPU: bit-identical for every method but EWC, MAS, RWalk, SI, AFEC and ZSCL, whose
    penalties are summed shard by shard, ≤ 3e-9), final weights likewise."""
    root, res, err = fsdp_runs
    for mode in ("ddp", "fsdp"):
        assert res.get(f"{mode}/{method}") == 0, f"{mode} {method}: {res.get(mode)} {err}"
    l1, l2 = _all_logs(root / "ddp" / method), _all_logs(root / "fsdp" / method)
    assert len(l1) == len(l2) > 0
    tol, rel = TOL.get(method, 1e-5), method in TOL
    for a, b in zip(l1, l2):
        keys = {k for k, v in a.items() if isinstance(v, float) and k != "samples_per_s"}
        assert keys == {k for k, v in b.items() if isinstance(v, float) and k != "samples_per_s"}
        for k in keys:
            assert abs(a[k] - b[k]) <= tol * (max(1.0, abs(a[k])) if rel else 1.0), (k, a, b)
    w1 = load_file(str(finished_tasks(root / "ddp" / method)[-1].model_path))
    w2 = load_file(str(finished_tasks(root / "fsdp" / method)[-1].model_path))
    assert w1.keys() == w2.keys()
    flips = method in MAGNITUDE_SELECTING or method in ADAM_NOISE
    if flips:
        assert_close_but_for_flips(w1, w2)
    else:
        assert_weights_close(w1, w2, atol=WEIGHT_ATOL, key_bias_atol=KEY_BIAS_ATOL)
    # the method's state after each task (Fisher, path integrals, anchors, merge weights,
    # buffers): whole tensors under the same keys, the same values
    for a, b in zip(finished_tasks(root / "ddp" / method), finished_tasks(root / "fsdp" / method)):
        s1, s2 = (load_file(str(c.path / "method_state.safetensors")) for c in (a, b))
        assert s1.keys() == s2.keys(), (a.path, set(s1) ^ set(s2))
        for k in s1:
            assert s1[k].shape == s2[k].shape and s1[k].dtype == s2[k].dtype, k
            if s1[k].is_floating_point() and not flips:
                assert torch.allclose(s1[k], s2[k], rtol=1e-4, atol=1e-6), k
            elif not s1[k].is_floating_point():
                assert torch.equal(s1[k], s2[k]), k


@pytest.mark.matrix
@pytest.mark.xdist_group("fsdp_runs")
@pytest.mark.parametrize("method", RESUMED)
def test_fsdp_run_resumed_after_a_crash_is_bitwise_the_same(method, fsdp_runs):
    root, res, err = fsdp_runs
    assert res.get(f"ref/{method}") == 0, err
    assert str(res.get(f"crash/{method}")).startswith("error: Crash: killed after"), err
    assert res.get(f"resume/{method}") == 0, err
    assert assert_same_run(root / "ref" / method, root / "crash" / method) == 2


@pytest.mark.matrix
@pytest.mark.xdist_group("fsdp_runs")
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_settings_under_fsdp_equal_them_without(setting, fsdp_runs):
    """Activation checkpointing (a checkpointed block gathers its weights again), gradient
    accumulation (reduce-scatter on the last micro-batch only), the fusion model, a tuning
    mode that freezes parameters. (bf16 cannot share the launch: Accelerate fixes the
    precision once per process.)"""
    root, res, err = fsdp_runs
    method = SETTINGS[setting][0]
    for mode in ("ddp", "fsdp"):
        assert res.get(f"{mode}-{setting}") == 0, f"{mode} {setting}: {err}"
    l1 = _all_logs(root / f"ddp-{setting}" / method)
    l2 = _all_logs(root / f"fsdp-{setting}" / method)
    assert len(l1) == len(l2) > 0
    w1 = load_file(str(finished_tasks(root / f"ddp-{setting}" / method)[-1].model_path))
    w2 = load_file(str(finished_tasks(root / f"fsdp-{setting}" / method)[-1].model_path))
    assert w1.keys() == w2.keys()
    tol, rel = TOL.get(method, 1e-5), method in TOL
    for a, b in zip(l1, l2):
        for k in {k for k, v in a.items() if isinstance(v, float) and k != "samples_per_s"}:
            assert abs(a[k] - b[k]) <= tol * (max(1.0, abs(a[k])) if rel else 1.0), (k, a, b)
    if method in ADAM_NOISE or method in MAGNITUDE_SELECTING:
        assert_close_but_for_flips(w1, w2)
    else:
        assert_weights_close(w1, w2, atol=WEIGHT_ATOL, key_bias_atol=KEY_BIAS_ATOL)
