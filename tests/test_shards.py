"""Shard write/read round trip, incl. a corrupt JPEG and an empty caption; batch determinism."""

from __future__ import annotations

import tarfile

import pytest
import torch
from PIL import Image

from cvl.data.reader import PairDataset, collate, global_batches, make_loader, rank_slice
from cvl.data.tokenizers import HashTokenizer
from cvl.data.transforms import image_transform
from cvl.errors import CvlError
from cvl.streams.writer import ShardSink, encode_jpeg


def _img(c: int) -> bytes:
    return encode_jpeg(Image.new("RGB", (16, 16), (c, 255 - c, 40)))


@pytest.fixture
def shard(tmp_path):
    sink = ShardSink(tmp_path, "train/t0", maxcount=4)
    for i in range(6):
        sink.write(
            f"s{i}", _img(i * 30), f"caption {i}", {"id": f"s{i}", "task": "t0", "category": i % 2}
        )
    sink.write(
        "bad", b"not a jpeg at all", "corrupt image", {"id": "bad", "task": "t0", "category": 0}
    )
    sink.write("empty", _img(9), "", {"id": "empty", "task": "t0", "category": 0})
    ss = sink.close()
    return tmp_path, ss


def test_real_tars_and_counts(shard):
    root, ss = shard
    assert ss.count == 8 and len(ss.shards) == 2
    names = tarfile.open(root / ss.shards[0]).getnames()
    assert sorted(names[:3]) == ["s0.jpg", "s0.json", "s0.txt"]


def test_round_trip_skips_and_replaces(shard):
    root, ss = shard
    ds = PairDataset.from_shards([root / s for s in ss.shards])
    assert ds.skipped == {"empty_caption": 1}
    assert len(ds) == 7  # the corrupt JPEG is indexed, replaced at load time
    items = [ds[i] for i in range(len(ds))]
    assert [it["caption"] for it in items[:6]] == [f"caption {i}" for i in range(6)]
    bad = items[6]
    assert bad["n_replaced"] == 1 and bad["caption"] == "caption 0"
    assert collate(items)["n_replaced"] == 1
    assert items[2]["category"] == 0 and items[3]["task"] == "t0"


def test_loader_tensors_and_rank_slices(shard):
    root, ss = shard
    tok = HashTokenizer(64, 8)
    ds = PairDataset.from_shards(
        [root / s for s in ss.shards], transform=image_transform(16, train=True), tokenize=tok
    )
    b1 = global_batches(len(ds), 4, seed=1, epoch=0)
    assert b1 == global_batches(len(ds), 4, seed=1, epoch=0)
    assert b1 != global_batches(len(ds), 4, seed=1, epoch=1)
    one = next(iter(make_loader(ds, b1)))
    halves = [next(iter(make_loader(ds, b1, rank=r, world=2))) for r in range(2)]
    assert one["image"].shape == (4, 3, 16, 16) and one["text"].shape == (4, 8)
    # two ranks' slices concatenated == the single-process batch, augmentation included
    assert torch.equal(torch.cat([h["image"] for h in halves]), one["image"])
    assert rank_slice(list(range(5)), 1, 2) == [3, 4]


def test_reader_with_nothing_usable_is_an_error(tmp_path):
    sink = ShardSink(tmp_path, "x")
    sink.write("e", _img(1), "", {"id": "e"})
    ss = sink.close()
    with pytest.raises(CvlError, match="no usable samples"):
        PairDataset.from_shards([tmp_path / s for s in ss.shards])
    (tmp_path / "junk.tar").write_bytes(b"garbage")
    with pytest.raises(CvlError, match="not a readable tar"):
        PairDataset.from_shards([tmp_path / "junk.tar"])
