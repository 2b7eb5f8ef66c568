"""Replay buffers: reservoir uniformity, ring quotas, k-means and herding selection/shrink."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cvl.data.index import Entries
from cvl.methods.buffers import build_buffer, quotas_by_size
from cvl.methods.buffers.base import Whole, positions
from cvl.methods.buffers.mof import herding_order

_BASE: dict[str, int] = {}


def _entries(task: str, n: int) -> Entries:
    """A stand-in for a task's training entries: n made-up packed ids, distinct per task (no
    shard is read: selection works on positions)."""
    base = _BASE.setdefault(task, (len(_BASE) + 1) << 40)
    return Entries.of_ids(base + np.arange(n, dtype=np.int64))


def _task_of(entries: Entries) -> str:
    first = int(entries.ids([0])[0])
    return next(t for t, b in _BASE.items() if b <= first < b + (1 << 40))


class _Services:
    def __init__(self, feats):
        self.feats = feats

    def pair_features(self, entries):
        return torch.tensor(self.feats[_task_of(entries)])


def _ctx(feats=None):
    return SimpleNamespace(accelerator=None, services=_Services(feats or {}))


def _items(b) -> dict[str, list[int]]:
    """The buffer's items as plain lists of positions."""
    return {t: positions(h).tolist() for t, h in b.items.items()}


def test_reservoir_is_uniform_over_everything_seen():
    n_tasks, per, size, trials = 3, 20, 10, 600
    counts = {}
    for seed in range(trials):
        b = build_buffer("reservoir", size, seed, None)
        for t in range(n_tasks):
            b.update(f"t{t}", _entries(f"t{t}", per), _ctx())
        assert len(b) == size
        for t, pos in _items(b).items():
            for i in pos:
                counts[t, i] = counts.get((t, i), 0) + 1
    freq = (
        np.array([counts.get((f"t{t}", i), 0) for t in range(n_tasks) for i in range(per)]) / trials
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
    first = set(_items(b)["a"])
    b.update("b", _entries("b", 50), _ctx())
    assert {t: len(v) for t, v in b.items.items()} == {"a": 6, "b": 6}
    assert set(_items(b)["a"]) <= first  # older task re-selected from what the buffer held
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
    b.update("a", es, _ctx({"a": np.concatenate(feats)}))
    kept = sorted(_items(b)["a"])
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
    b.update("a", _entries("a", 5), _ctx({"a": feats}))
    herded = _items(b)["a"]
    assert herded == order[:4]
    b.update("b", _entries("b", 5), _ctx({"a": feats, "b": feats}))
    assert _items(b)["a"] == herded[:2]  # shrinking keeps the best (first) herded items


def test_state_round_trip():
    b = build_buffer("reservoir", 5, 1, None)
    b.update("a", _entries("a", 9), _ctx())
    c = build_buffer("reservoir", 5, 1, None)
    c.load_state_dict(b.state_dict())
    b.update("b", _entries("b", 9), _ctx())
    c.update("b", _entries("b", 9), _ctx())
    assert _items(b) == _items(c)


# -- TiC-CLIP's cumulative policies (hand-made time steps) -------------------------------------
def _fill(name: str, size: int, sizes: dict[str, int], seed: int = 0):
    """The buffer after each step (task name = period), as {period: items kept}."""
    b = build_buffer(name, size, seed, None)
    after = []
    for t, n in sizes.items():
        b.update(t, _entries(t, n), _ctx())
        after.append(_items(b))
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
    assert after[-1] == {"2016": list(range(5)), "2017": list(range(3))}
    assert len(b) == 8 and b.unbounded
    assert b.items == {"2016": Whole(5), "2017": Whole(3)}  # no array: 0 bytes a sample
    want = np.concatenate([_entries("2016", 5).all_ids(), _entries("2017", 3).all_ids()])
    assert np.array_equal(b.entries().all_ids(), want)


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
    assert _items(b) == _items(c)


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


def test_reservoir_draws_are_algorithm_r_item_by_item():
    """The vectorised selection keeps exactly what Algorithm R keeps visiting the items one by
    one (one `integers(0, n_seen)` draw per item once the slots are full)."""
    size, tasks = 7, [("a", 12), ("b", 30), ("c", 4)]
    b = build_buffer("reservoir", size, 3, None)
    slots, n_seen = [], 0
    for k, (t, n) in enumerate(tasks):
        b.update(t, _entries(t, n), _ctx())
        rng = np.random.default_rng([3, 991, k + 1])  # the task number, counted from 1
        for i in rng.permutation(n):
            n_seen += 1
            if len(slots) < size:
                slots.append((t, int(i)))
            else:
                j = int(rng.integers(0, n_seen))
                if j < size:
                    slots[j] = (t, int(i))
        want: dict[str, list[int]] = {}
        for t2, i in slots:
            want.setdefault(t2, []).append(i)
        assert _items(b) == want and list(b.items) == list(want)


def test_membership_of_a_million_items_is_a_search_in_one_sorted_array():
    """in_buffer / payload_rows on a 1,000,000-item buffer: the items' packed ids are computed
    and sorted once per buffer content, each batch is one vectorised search (a few hundred µs
    for 256 rows on the 2-core dev machine; 361 ms with a set of every item per call)."""
    n = 1_000_000
    t0 = Entries.of_ids(np.arange(2 * n, dtype=np.int64) * 3 + 7)  # position p: id 3p + 7
    calls = []
    t0_ids = t0.ids
    t0.ids = lambda pos: calls.append(len(pos)) or t0_ids(pos)
    b = build_buffer("ring", n, 0, None, entries_of={"t0": t0}.__getitem__)
    b.items = {"t0": np.arange(0, 2 * n, 2, dtype=np.int64)[::-1].copy()}  # even positions
    b.sizes = {"t0": 2 * n}
    q = np.arange(256, dtype=np.int64) * 7919 % (2 * n)
    batch = {"sid": (3 * q + 7).tolist()[:-2] + [5, -1]}  # 5, -1: no sample of the task
    want = np.r_[q[:-2] % 2 == 0, False, False]
    for _ in range(3):
        assert np.array_equal(b.in_buffer(batch).numpy(), want)
    b.set_payload([("t0", int(q[0])), ("t0", 4)], x=torch.tensor([[1.0], [2.0]]))
    mask, rows = b.payload_rows(
        {"sid": [7 + 3 * 4, 3 * int(q[0]) + 7, 7 + 3 * 3]}, "x", torch.zeros(1, 1)
    )
    assert mask.tolist() == [True, True, False] and rows[:, 0].tolist() == [2.0, 1.0, 0.0]
    assert calls == [n]  # the items' ids once, for every call above
    b.update("t1", _entries("t1", 10), _ctx())  # new contents: a new index
    got = b.in_buffer({"sid": _entries("t1", 10).all_ids().tolist()})
    assert int(got.sum()) == len(b.items["t1"]) == 10 and len(b.items["t0"]) == n // 2
    p = np.arange(64)
    assert np.array_equal(b.in_buffer({"sid": 3 * p + 7}).numpy(), np.isin(p, b.items["t0"]))


def _shards(root, task: str, keys: list[str]):
    from PIL import Image

    from cvl.streams.writer import ShardSink, encode_jpeg

    sink = ShardSink(root, f"train/{task}", maxcount=4)
    for k in keys:
        sink.write(k, encode_jpeg(Image.new("RGB", (2, 2))), f"caption {k}", {})
    return sink.close().shards  # relative to root, as an earlier cvl saved them


def test_a_state_saved_as_shard_key_refs_loads_into_the_same_positions(tmp_path):
    """An earlier cvl's buffer state ([shard, key] lists, relative to the stream folder, in
    JSON) loads as the positions of those samples in each task's training entries: items,
    reservoir slots and payload; a sample the task no longer has is an error."""
    from cvl.errors import CvlError
    from cvl.train.checkpoint import load_state, save_state

    a = _shards(tmp_path, "t0", [f"s{i}" for i in range(6)])  # shards of s0-s3 and s4-s5
    c = _shards(tmp_path, "t1", ["u0", "u1", "u2"])
    tasks = {"t0": Entries.of_shards([tmp_path / s for s in a])}
    tasks["t1"] = Entries.of_shards([tmp_path / s for s in c])
    old = {
        "name": "reservoir",
        "size": 3,
        "items": {"t0": [[a[1], "s5"], [a[0], "s1"]], "t1": [[c[0], "u2"]]},
        "sizes": {"t0": 6, "t1": 3},
        "payload": {
            "x": {"refs": [[a[0], "s1"], [c[0], "u2"]], "rows": torch.tensor([[1.0], [2.0]])}
        },
        "slots": [["t0", a[1], "s5"], ["t1", c[0], "u2"], ["t0", a[0], "s1"]],
        "n_seen": 9,
    }
    save_state(tmp_path, "st", {"buffer": old})
    b = build_buffer("reservoir", 3, 0, str(tmp_path), tasks.__getitem__)
    b.load_state_dict(load_state(tmp_path, "st")["buffer"])
    assert _items(b) == {"t0": [5, 1], "t1": [2]}  # s5 is row 1 of the second shard: 4 + 1
    assert b.slot_pos.tolist() == [5, 2, 1]
    assert [b.slot_tasks[i] for i in b.slot_task] == ["t0", "t1", "t0"]
    assert {k: v["x"].tolist() for k, v in b.payload.items()} == {
        ("t0", 1): [1.0],
        ("t1", 2): [2.0],
    }
    assert [e.key for e in b.entries()] == ["s5", "s1", "u2"]
    save_state(tmp_path, "new", {"buffer": b.state_dict()})  # saved again: integer arrays
    again = build_buffer("reservoir", 3, 0, str(tmp_path), tasks.__getitem__)
    again.load_state_dict(load_state(tmp_path, "new")["buffer"])
    assert _items(again) == _items(b) and again.payload.keys() == b.payload.keys()
    assert again.slot_pos.tolist() == [5, 2, 1] and again.n_seen == 9
    whole = {"items": {"t1": [[c[0], f"u{i}"] for i in range(3)]}, "sizes": {"t1": 3}}
    cum = build_buffer("cumulative-all", 0, 0, str(tmp_path), tasks.__getitem__)
    cum.load_state_dict(whole)
    assert cum.items == {"t1": Whole(3)}
    again.resolve = {"t0": tasks["t1"], "t1": tasks["t1"]}.__getitem__  # t0 now 3 samples
    with pytest.raises(CvlError, match="task 't0' has 3 training samples, the buffer was built"):
        again.entries()
    old["items"]["t1"] = [[c[0], "gone"]]
    with pytest.raises(CvlError, match="no training sample 'gone'"):
        b.load_state_dict(old)
