"""Replay buffers: reservoir uniformity, ring quotas, k-means and herding selection/shrink."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cvl.data.reader import Entry
from cvl.methods.buffers import build_buffer, quotas_by_size
from cvl.methods.buffers.mof import herding_order


def _entries(task: str, n: int) -> list[Entry]:
    return [Entry(f"/s/{task}.tar", f"{task}-{i}", (0, 1), (0, 1), None) for i in range(n)]


class _Services:
    def __init__(self, feats):
        self.feats = feats

    def pair_features(self, entries):
        import torch

        return torch.tensor(self.feats[entries[0].shard])


def _ctx(feats=None):
    return SimpleNamespace(accelerator=None, services=_Services(feats or {}))


def test_reservoir_is_uniform_over_everything_seen():
    n_tasks, per, size, trials = 3, 20, 10, 600
    counts = {}
    for seed in range(trials):
        b = build_buffer("reservoir", size, seed, None)
        for t in range(n_tasks):
            b.update(f"t{t}", _entries(f"t{t}", per), _ctx())
        assert len(b) == size
        for refs in b.items.values():
            for _, key in refs:
                counts[key] = counts.get(key, 0) + 1
    freq = (
        np.array([counts.get(f"t{t}-{i}", 0) for t in range(n_tasks) for i in range(per)]) / trials
    )
    # every one of the 60 items is kept with probability size/60 = 1/6 (binomial sd ≈ 0.015)
    assert abs(freq.mean() - size / 60) < 1e-9
    assert np.all(np.abs(freq - 1 / 6) < 0.07)
    per_task = [freq[t * per : (t + 1) * per].mean() for t in range(n_tasks)]
    assert max(per_task) - min(per_task) < 0.04  # old tasks not favoured or starved


def test_ring_equal_quotas_reselected_from_buffer():
    b = build_buffer("ring", 12, 0, None)
    b.update("a", _entries("a", 50), _ctx())
    assert [len(v) for v in b.items.values()] == [12]
    first = set(b.items["a"])
    b.update("b", _entries("b", 50), _ctx())
    assert {t: len(v) for t, v in b.items.items()} == {"a": 6, "b": 6}
    assert set(b.items["a"]) <= first  # older task re-selected from what the buffer held
    b.update("c", _entries("c", 3), _ctx())
    assert {t: len(v) for t, v in b.items.items()} == {"a": 4, "b": 4, "c": 3}


def test_quota_proportional_to_task_size():
    assert quotas_by_size({"a": 100, "b": 300}, 40) == {"a": 10, "b": 30}
    q = quotas_by_size({"a": 1, "b": 1, "c": 1}, 10)
    assert sum(q.values()) <= 10 and min(q.values()) == 3


def test_kmeans_keeps_one_item_per_cluster_nearest_centroid():
    rng = np.random.default_rng(0)
    centres = np.eye(4) * 10
    feats, nearest = [], []
    for c in range(4):
        pts = centres[c] + rng.normal(0, 0.5, (10, 4))
        pts[3] = centres[c] + 0.01  # the planted nearest point of each cluster
        nearest.append(c * 10 + 3)
        feats.append(pts)
    b = build_buffer("kmeans", 4, 0, None)
    es = _entries("a", 40)
    b.update("a", es, _ctx({"/s/a.tar": np.concatenate(feats)}))
    kept = sorted(int(k.split("-")[1]) for _, k in b.items["a"])
    assert kept == nearest


def test_herding_order_and_shrink_keeps_the_prefix():
    feats = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [5.0, 5.0], [9.0, 9.0]])
    # mean = (4.8, 4.8): (5, 5) first; then the item that moves the mean of 2 closest ...
    order = herding_order(feats, 5)
    assert order[0] == 3
    assert sorted(order) == [0, 1, 2, 3, 4]
    mu = feats.mean(0)
    acc = feats[3].copy()
    best = min(
        (i for i in range(5) if i != 3), key=lambda i: np.sum(((acc + feats[i]) / 2 - mu) ** 2)
    )
    assert order[1] == best
    b = build_buffer("mof", 4, 0, None)
    b.update("a", _entries("a", 5), _ctx({"/s/a.tar": feats}))
    herded = list(b.items["a"])
    assert [int(k.split("-")[1]) for _, k in herded] == order[:4]
    b.update("b", _entries("b", 5), _ctx({"/s/a.tar": feats, "/s/b.tar": feats}))
    assert b.items["a"] == herded[:2]  # shrinking keeps the best (first) herded items


def test_state_round_trip():
    b = build_buffer("reservoir", 5, 1, None)
    b.update("a", _entries("a", 9), _ctx())
    c = build_buffer("reservoir", 5, 1, None)
    c.load_state_dict(b.state_dict())
    b.update("b", _entries("b", 9), _ctx())
    c.update("b", _entries("b", 9), _ctx())
    assert b.items == c.items


# -- TiC-CLIP's cumulative policies (hand-made time steps) -------------------------------------
def _fill(name: str, size: int, sizes: dict[str, int], seed: int = 0):
    """The buffer after each step (task name = period), as {period: items kept}."""
    b = build_buffer(name, size, seed, None)
    after = []
    for t, n in sizes.items():
        b.update(t, _entries(t, n), _ctx())
        after.append({k: list(v) for k, v in b.items.items()})
    return b, after


def _counts(after):
    return [{t: len(v) for t, v in a.items()} for a in after]


def _nested(after):
    """Every period's items after step s+1 are a subset of what it held after step s."""
    for prev, cur in zip(after, after[1:]):
        for t, items in cur.items():
            if t in prev:
                assert set(items) <= set(prev[t]), t


YEARS = {"2016": 40, "2017": 40, "2018": 40, "2019": 40, "2020": 40}


def test_cumulative_exp_halves_old_steps_per_step():
    """TiC: 'at the 3rd step it retains D/2, D/2 of old data and at the 4th D/2, D/4, D/4'
    (the buffer after step t is what step t+1 replays); D = 8."""
    _, after = _fill("cumulative-exp", 8, YEARS)
    assert _counts(after) == [
        {"2016": 8},
        {"2016": 4, "2017": 4},  # replayed at the 3rd step
        {"2016": 2, "2017": 2, "2018": 4},  # at the 4th: D/4, D/4, D/2
        {"2016": 1, "2017": 1, "2018": 2, "2019": 4},
        {"2016": 0, "2017": 0, "2018": 1, "2019": 2, "2020": 5},  # ⌊½⌋ lost to the newest
    ]
    _nested(after)
    _, odd = _fill("cumulative-exp", 10, YEARS)  # rounding: old ⌊half⌋, the newest the rest
    assert _counts(odd)[:3] == [
        {"2016": 10},
        {"2016": 5, "2017": 5},
        {"2016": 2, "2017": 2, "2018": 6},
    ]
    assert all(sum(c.values()) == 10 for c in _counts(odd))


def test_cumulative_equal_splits_the_budget_among_past_steps():
    """TiC: 'at the 4th step it retains D/3, D/3, D/3'; the remainder goes to the newest."""
    _, after = _fill("cumulative-equal", 9, YEARS)
    assert _counts(after) == [
        {"2016": 9},
        {"2016": 4, "2017": 5},
        {"2016": 3, "2017": 3, "2018": 3},
        {"2016": 2, "2017": 2, "2018": 2, "2019": 3},
        {"2016": 1, "2017": 1, "2018": 1, "2019": 1, "2020": 5},
    ]
    _nested(after)
    # a step with less data than its share keeps all it has; its unused share goes to the
    # steps that have more: min(D, items seen) = 9 held (⌊9/2⌋ = 4 for "a", 5 for "b")
    _, small = _fill("cumulative-equal", 9, {"a": 40, "b": 2})
    assert _counts(small)[-1] == {"a": 7, "b": 2}
    _nested(_fill("cumulative-equal", 9, {"a": 40, "b": 2, "c": 40})[1])


def test_cumulative_exp_gives_a_short_steps_unused_quota_to_the_others():
    """The issue's case: sizes 1,503 then 87, D = 4,096: halving keeps 751 + 87 = 838; a buffer
    of D holds min(D, data seen) = 1,590 (every item). Then a full step of 5,000: the shares
    ⌊1503/2⌋ = 751, ⌊87/2⌋ = 43, new 4096 − 794 = 3,302 fit; all D held."""
    _, after = _fill("cumulative-exp", 4096, {"a": 1503, "b": 87, "c": 5000})
    assert _counts(after) == [
        {"a": 1503},
        {"a": 1503, "b": 87},
        {"a": 751, "b": 43, "c": 3302},
    ]
    _nested(after)
    # short new step, then old steps newest first: D = 10, shares 5 old / 5 new, new has 2
    _, after = _fill("cumulative-exp", 10, {"a": 40, "b": 40, "c": 2})
    assert _counts(after) == [{"a": 10}, {"a": 5, "b": 5}, {"a": 3, "b": 5, "c": 2}]


def test_cumulative_all_keeps_every_past_pair_in_order():
    b, after = _fill("cumulative-all", 0, {"2016": 5, "2017": 3})
    assert after[-1] == {
        "2016": [("/s/2016.tar", f"2016-{i}") for i in range(5)],
        "2017": [("/s/2017.tar", f"2017-{i}") for i in range(3)],
    }
    assert len(b) == 8 and b.unbounded


def test_ring_is_unchanged_by_the_quota_base():
    """DHA's ring keeps ⌊|M|/t⌋ per task (the remainder unused), the same draws as before."""
    _, after = _fill("ring", 9, YEARS)
    assert _counts(after)[1] == {"2016": 4, "2017": 4}
    assert _counts(after)[4] == dict.fromkeys(YEARS, 1)


@pytest.mark.parametrize("name", ["cumulative-all", "cumulative-equal", "cumulative-exp"])
def test_cumulative_state_round_trip(name):
    size = 0 if name == "cumulative-all" else 6
    b, _ = _fill(name, size, {"a": 9, "b": 9})
    c = build_buffer(name, size, 0, None)
    c.load_state_dict(b.state_dict())
    b.update("c", _entries("c", 9), _ctx())
    c.update("c", _entries("c", 9), _ctx())
    assert b.items == c.items


def test_buffer_choices_of_the_cli_are_the_registry():
    from cvl.methods.buffers import buffer_names
    from cvl.train.cli import BUFFER_CHOICES

    assert sorted(BUFFER_CHOICES) == sorted(buffer_names())


def test_buffer_size_rules():
    from cvl.errors import CvlError
    from cvl.train.config import TrainConfig

    base = dict(stream="s", out="o")
    TrainConfig(**base, buffer="cumulative-all").validate()
    with pytest.raises(CvlError, match="takes no --buffer-size"):
        TrainConfig(**base, buffer="cumulative-all", buffer_size=5).validate()
    with pytest.raises(CvlError, match="needs a positive --buffer-size"):
        TrainConfig(**base, buffer="cumulative-exp").validate()
    with pytest.raises(CvlError, match="unknown buffer 'nope'"):
        TrainConfig(**base, buffer="nope", buffer_size=3).validate()
