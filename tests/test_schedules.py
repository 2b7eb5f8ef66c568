"""Learning-rate schedules (cvl/train/schedules.py): every schedule against rates computed by
hand at chosen steps (numbers from the closed forms of FoMo-in-Flux's code, written out in
each comment), the TiC warm start, and the stream plan under --budget end to end."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from reliability_helpers import cli

from cvl.errors import CvlError
from cvl.train.schedules import SCHEDULES, TaskPosition, check_schedule, lr_multiplier


def cfg(name: str, warmup: float = 0.2, min_lr: float = 0.0, **kw):
    d = dict(lr=1.0, min_lr=min_lr, warmup=warmup, warmup_later=None, cooldown=0.1)
    return SimpleNamespace(lr_schedule=name, **{**d, **kw})


def rates(c, pos, steps):
    f = lr_multiplier(c, pos)
    return [f(n) for n in steps]


def test_cvl_cosine_is_unchanged_and_tic_warm_start_shortens_later_warmups():
    # cvl's cosine: round(0.25 * 10) = 2 warm-up steps (FoMo's ceil would give 3)
    assert rates(cfg("cosine", 0.25), TaskPosition(0, 10), [0, 1, 2]) == pytest.approx(
        [0.5, 1.0, 1.0]
    )
    # TiC-CLIP: 5 warm-up steps on the first task, 2 on every later one (fresh optimizer)
    c = cfg("cosine", 5, warmup_later=2)
    assert rates(c, TaskPosition(0, 10), [0, 4]) == pytest.approx([1 / 5, 1.0])
    assert rates(c, TaskPosition(1, 10, (10,)), [0, 1]) == pytest.approx([1 / 2, 1.0])
    assert rates(c, TaskPosition(2, 10, (10, 10)), [0]) == pytest.approx([1 / 2])


def test_cosine_fomo():
    # S = 10, warm-up ceil(0.25 * 10) = 3, r = 0.1: n < 3: (n+1)/3; then
    # 0.1 + 0.9 * ½(1 + cos(π (n - 3 + 1) / 7)); the last step (n = 9) reaches the floor
    f = lr_multiplier(cfg("cosine-fomo", 0.25, 0.1), TaskPosition(0, 10))
    assert [f(0), f(2)] == pytest.approx([1 / 3, 1.0])
    assert f(3) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 7)))
    assert f(9) == pytest.approx(0.1)
    # S = 10, W = 2: n = 2 -> 0.1 + 0.9 · ½(1 + cos(π/8)) = 0.96574579
    g = lr_multiplier(cfg("cosine-fomo", 0.2, 0.1), TaskPosition(0, 10))
    assert g(2) == pytest.approx(0.9657457896, abs=1e-9)


def test_cosine_autoregressive_meta_schedule():
    # two tasks of S = 10, W = 2, r = 0; task 1's peak: ½(1 + cos(π (1·8 + 1) / (2·8)))
    # = ½(1 + cos(9π/16)) = 0.40245484 (FoMo: e = t(S-W)+1, es = (t+1)(S-W))
    c = cfg("cosine-ar", 0.2)
    assert rates(c, TaskPosition(0, 10), [0, 1, 9]) == pytest.approx([0.5, 1.0, 0.0])
    f = lr_multiplier(c, TaskPosition(1, 10, (10,)))
    assert f(1) == pytest.approx(0.4024548390, abs=1e-9)  # the warm-up's end: the peak
    assert f(0) == pytest.approx(0.2012274195, abs=1e-9)  # peak · 1/2
    assert f(2) == pytest.approx(0.3871373137, abs=1e-9)  # peak · ½(1 + cos(π/8))
    assert f(9) == pytest.approx(0.0)
    # with a floor r = 0.1 the peak is r + (1 - r) · 0.40245484
    g = lr_multiplier(cfg("cosine-ar", 0.2, 0.1), TaskPosition(1, 10, (10,)))
    assert g(1) == pytest.approx(0.1 + 0.9 * 0.4024548390, abs=1e-9)
    # unequal tasks: the earlier tasks' decay steps as trained (12 - ceil(2.4) = 9, 10 - 2 = 8)
    h = lr_multiplier(c, TaskPosition(2, 10, (12, 10)))
    assert h(1) == pytest.approx(0.5 * (1 + math.cos(math.pi * 18 / 25)))


def test_cosine_dynamic_meta_schedule():
    # task 1 (S = 10, W = 2): warm-up to the AR peak, then FoMo's cosine over H = 20 steps
    # (its warm-up ceil(0.2 · 20) = 4) at G = 10 + n: n = 2 -> ½(1 + cos(π (12 - 4 + 1) / 16))
    f = lr_multiplier(cfg("cosine-dyn", 0.2), TaskPosition(1, 10, (10,)))
    assert f(0) == pytest.approx(0.2012274195, abs=1e-9)
    assert f(2) == pytest.approx(0.4024548390, abs=1e-9)  # = the peak: continuous here
    assert f(5) == pytest.approx(0.5 * (1 + math.cos(math.pi * 12 / 16)))
    assert f(9) == pytest.approx(0.0)
    # the first task is plain cosine-fomo
    g = lr_multiplier(cfg("cosine-dyn", 0.2, 0.1), TaskPosition(0, 10))
    assert g(2) == pytest.approx(0.9657457896, abs=1e-9)


def test_rsqrt_with_cooldown():
    # S = 20, W = ceil(0.1 · 20) = 2, C = ceil(0.2 · 20) = 4 (cool-down from n = 16), r = 0.1:
    # n = 8: 0.1 + √(2/8) · 0.9 = 0.55; n = 16: (0.1 + √(2/16) · 0.9) · (4 - 0 - 1)/4 = 0.31364854
    f = lr_multiplier(cfg("rsqrt", 0.1, 0.1, cooldown=0.2), TaskPosition(0, 20))
    assert [f(0), f(1), f(2)] == pytest.approx([0.5, 1.0, 1.0])
    assert f(8) == pytest.approx(0.55)
    assert f(16) == pytest.approx(0.3136485387, abs=1e-9)
    assert f(19) == pytest.approx(0.0)  # FoMo's cool-down ends at 0 on the last step
    # cool-down and warm-up given in steps
    g = lr_multiplier(cfg("rsqrt", 4, 0.0, cooldown=2), TaskPosition(0, 20))
    assert [g(3), g(16), g(18), g(19)] == pytest.approx([1.0, 0.5, 0.5 * math.sqrt(4 / 18), 0])


def test_rsqrt_meta_schedules():
    c = dict(cooldown=0.2)
    # autoregressive, task 1 of S = 20, W = 2: peak = 0.1 + 0.9 · √((2 + 2) / (20 + 2))
    # = 0.48376129 (FoMo: √((t+1)W / (tS+W))); n = 8: 0.1 + √(2/8) · (peak - 0.1) = 0.29188064
    f = lr_multiplier(cfg("rsqrt-ar", 0.1, 0.1, **c), TaskPosition(1, 20, (20,)))
    assert f(1) == pytest.approx(0.4837612894, abs=1e-9)
    assert f(8) == pytest.approx(0.2918806447, abs=1e-9)
    # continued, task 2: one rsqrt curve at W + 2 (S - C - W) = 2 + 2 · 14 = 30 (FoMo:
    # t(S-C) - (t-1)W = 32 - 2): peak = 0.1 + 0.9 · √(2/30) = 0.33237900
    g = lr_multiplier(cfg("rsqrt-cont", 0.1, 0.1, **c), TaskPosition(2, 20, (20, 20)))
    assert g(1) == pytest.approx(0.3323790008, abs=1e-9)
    # the first task of either is plain rsqrt
    h = lr_multiplier(cfg("rsqrt-ar", 0.1, 0.1, **c), TaskPosition(0, 20))
    assert h(16) == pytest.approx(0.3136485387, abs=1e-9)


def test_rsqrt_recovery_peaks_are_capped_where_the_warmup_outlasts_the_task():
    """W = 30 steps, S = 20, C = 2 (outside FoMo's domain, W > S − C): FoMo's rsqrt-ar peak
    √(2·30 / (20 + 30)) = √1.2 and rsqrt-cont's √(30 / (2·18 − 30)) = √5 exceed 1 (task 2's
    denominator 3·18 − 2·30 < 0); cvl caps both at --lr: the warm-up ends at 1 (step W − 1)."""
    c = dict(cooldown=2)
    for name, pos in (
        ("rsqrt-ar", TaskPosition(1, 20, (20,))),
        ("rsqrt-cont", TaskPosition(2, 20, (20, 20))),
    ):
        f = lr_multiplier(cfg(name, 30, 0.0, **c), pos)
        assert f(29) == 1.0 and f(0) == pytest.approx(1 / 30)


def test_stream_cosine_over_the_plan():
    # plan 10 + 20 + 10 steps, warm-up 0.1 · 40 = 4 steps, r = 0: one cosine over 40 steps
    c = cfg("stream-cosine", 0.1)
    plan = (10.0, 20.0, 10.0)
    assert lr_multiplier(c, TaskPosition(0, 10, (), plan))(0) == pytest.approx(0.25)
    # task 1, n = 0: global step 10, p = 6/36: ½(1 + cos(π/6)) = 0.93301270
    assert lr_multiplier(c, TaskPosition(1, 20, (10,), plan))(0) == pytest.approx(
        0.9330127019, abs=1e-9
    )
    # task 2, n = 9: global step 39, p = 35/36: ½(1 + cos(35π/36)) = 0.00190265
    assert lr_multiplier(c, TaskPosition(2, 10, (10, 20), plan))(9) == pytest.approx(
        0.0019026510, abs=1e-9
    )
    # budget shares as the plan (1, 2, 1) and the steps the budget bought (7, 13, 5): each
    # task covers exactly its part of the curve, task 1 starting at p = (1 - 0.4) / 3.6 = 1/6
    shares = (1.0, 2.0, 1.0)
    assert lr_multiplier(c, TaskPosition(1, 13, (7,), shares))(0) == pytest.approx(
        0.9330127019, abs=1e-9
    )
    # a warm-up of 2 steps: the first task's first 2 steps (plan 10 steps for 10 trained)
    w = cfg("stream-cosine", 2)
    f = lr_multiplier(w, TaskPosition(0, 10, (), plan))
    assert [f(0), f(1)] == pytest.approx([0.5, 1.0])
    assert f(2) == pytest.approx(1.0)


def test_schedule_options_are_checked():
    check_schedule(cfg("cosine", 0.0))
    with pytest.raises(CvlError, match="must be one of"):
        check_schedule(cfg("wsd"))
    with pytest.raises(CvlError, match="needs a warm-up"):
        check_schedule(cfg("rsqrt", 0.0))
    with pytest.raises(CvlError, match="needs a warm-up"):
        check_schedule(cfg("rsqrt-ar", 0.1, warmup_later=0))
    with pytest.raises(CvlError, match="--cooldown must be >= 0"):
        check_schedule(cfg("rsqrt", 0.1, cooldown=-1))
    assert "wsd" not in SCHEDULES  # listed by FoMo's code but never implemented there


@pytest.mark.slow
def test_stream_cosine_plan_under_a_budget(tmp_path):
    """--budget samples=72 over 3 tasks of 32 pairs, batch 8: the plan is the budget shares
    (24 samples each), each task trains 24 / 8 = 3 steps, and the rate of the last step is
    the stream cosine at v = 2·24 + 24·2/3 = 64 of 72: ½(1 + cos(8π/9)) · lr."""
    from reliability_helpers import build_tiny_stream, train_argv

    stream = build_tiny_stream(tmp_path / "s")
    run = tmp_path / "run"
    argv = train_argv(stream, run, "seqft")
    argv += ["--budget", "samples=72", "--lr-schedule", "stream-cosine", "--log-every", "1"]
    cli(argv)
    rec = json.loads((run / "run.json").read_text())["lr_schedule"]
    assert rec["plan"] == [24.0, 24.0, 24.0] and rec["plan_unit"] == "budget share"
    logs = [
        json.loads(x)
        for t in ("00-t0", "01-t1", "02-t2")
        for x in (run / "tasks" / t / "train_log.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in logs] == [1, 2, 3] * 3
    lr = 5e-4  # cvl train's default --lr
    want = [0.5 * (1 + math.cos(math.pi * g / 9)) * lr for g in range(9)]
    assert [r["lr"] for r in logs] == pytest.approx(want, rel=1e-6)
    assert logs[-1]["lr"] == pytest.approx(0.0301536896 * lr, rel=1e-6)
