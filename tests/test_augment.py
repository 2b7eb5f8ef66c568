"""The split training augmentation (cvl/data/augment.py) against the per-sample Compose.

Tolerances, in levels of 0..255 (the normalised tensors are mapped back by × std × 255):
- resize in the worker, no draft: bit-identical;
- resize on the device, no draft: at most 2 levels, in under 0.1 % of the values (bicubic;
  PIL's own fixed-point weights, but float32 sums instead of its integer ones: a rounding tie
  may go the other way in a pass, and the second pass can amplify the first's);
- JPEG draft mode (decoded at 1/2-1/8 scale where the crop stays ≥ the output size): the
  mean difference is at most 1.25 × that between bilinear and bicubic resampling of the same
  crops (an interpolation difference), the largest at most 1.5 × its largest (+ 1).
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from cvl.data.augment import (
    SplitTransform,
    crop_box,
    device_images,
    resize_weights,
    split_transform,
    train_transform,
    vertical_first,
)
from cvl.data.reader import (
    PairDataset,
    _seeded,
    collate,
    default_workers,
    global_batches,
    make_loader,
)
from cvl.data.tokenizers import HashTokenizer
from cvl.data.transforms import image_transform
from cvl.streams.writer import ShardSink

CPU = torch.device("cpu")
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)


def photo(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """Smooth colour blobs + edges + grain: a JPEG with a photo's mix of frequencies."""
    x = rng.normal(size=(h // 8 + 2, w // 8 + 2, 3))
    im = Image.fromarray(np.uint8(np.clip(128 + 60 * x, 0, 255))).resize((w, h), Image.BICUBIC)
    a = np.asarray(im).astype(float) + rng.normal(size=(h, w, 3)) * 6
    a[: h // 3, w // 2 :] *= 0.5  # a hard edge
    return Image.fromarray(np.uint8(np.clip(a, 0, 255)))


SIZES = [(640, 480), (480, 640), (300, 200), (224, 224), (1000, 700), (60, 50), (33, 97)]
SIZES += [(60, 400)]  # at 64 px PIL resizes its crop vertically first


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    sink = ShardSink(root, "p")
    for k in range(2 * len(SIZES)):
        w, h = SIZES[k % len(SIZES)]
        buf = io.BytesIO()
        img = photo(rng, w, h)
        if k == 3:
            img = img.convert("L")  # a greyscale JPEG
        img.save(buf, "JPEG", quality=90, progressive=k % 4 == 1)
        sink.write(f"k{k}", buf.getvalue(), f"photo {k}", {})
    buf = io.BytesIO()
    photo(rng, 120, 90).save(buf, "PNG")  # not a JPEG: PIL decodes it, no draft
    sink.write("png", buf.getvalue(), "a png", {})
    return [root / s for s in sink.close().shards]


def _levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a - b) * STD * 255).abs()


def _images(shards, transform, items) -> torch.Tensor:
    ds = PairDataset.from_shards(shards, transform=transform)
    batch = collate([ds[it] for it in items])
    return device_images(batch, transform, CPU)


def test_crop_box_is_torchvisions_get_params():
    """The same draws, arithmetic and fallback (the 10 tries failing on a thin image)."""
    for scale, ratio in [((0.9, 1.0), (3 / 4, 4 / 3)), ((0.2, 1.0), (3 / 4, 4 / 3))]:
        log_ratio = torch.log(torch.tensor(ratio)).tolist()
        for w, h in [(640, 480), (224, 224), (33, 97), (500, 20), (7, 300)]:
            img = Image.new("RGB", (w, h))
            for seed in range(40):
                with _seeded(seed):
                    want = T.RandomResizedCrop.get_params(img, list(scale), list(ratio))
                    after_want = torch.rand(1)
                with _seeded(seed):
                    got = crop_box(w, h, scale, ratio, log_ratio)
                    after_got = torch.rand(1)
                assert got == want and torch.equal(after_got, after_want)


@pytest.mark.parametrize("augment", ["openclip", "none", "ctp"])
@pytest.mark.parametrize("size", [224, 64])
def test_split_transform_computes_the_compose(photos, augment, size):
    compose = image_transform(size, train=True, augment=augment)
    items = [(i, 1000 + i) for i in range(len(PairDataset.from_shards(photos)))]
    want = _images(photos, compose, items)

    # the crop boxes and flips: the same draws as the Compose, in the same order
    st = split_transform(compose, resize_on_device=False)
    ds = PairDataset.from_shards(photos)
    for i, seed in items:
        _, header = ds._open(i)
        with _seeded(seed):
            plan = st.prepare(header)
        if augment == "none":
            assert plan.box is None and not plan.flip
            continue
        _, header = ds._open(i)  # (prepare may have set draft mode on the first one)
        with _seeded(seed):
            box = T.RandomResizedCrop.get_params(header, list(st.scale), list(st.ratio))
            flip = bool(torch.rand(1) < 0.5) if augment == "ctp" else False
        assert plan.box == box and plan.flip == flip

    # resize in the worker, no draft: bit-identical; on the device: PIL's values ± 1 in ties
    exact = _images(photos, split_transform(compose, resize_on_device=False, draft=False), items)
    assert torch.equal(exact, want)
    if augment != "ctp":  # RandAugment keeps CTP's resize in the worker
        dev = split_transform(compose, resize_on_device=True, draft=False)
        assert dev.resize_on_device
        ds_dev = PairDataset.from_shards(photos, transform=dev)
        orders = vertical_first(collate([ds_dev[it] for it in items])["image_geom"])
        if augment == "openclip":  # both of PIL's pass orders in one batch at 64 px
            assert orders.any() and not orders.all() if size == 64 else not orders.any()
        d = _levels(_images(photos, dev, items), want)
        assert d.max() <= 2.0 + 1e-3 and (d > 0.5).float().mean() < 1e-3

    # draft mode: within an interpolation difference (bilinear vs bicubic on the same crops)
    drafted = split_transform(compose, resize_on_device=augment != "ctp")
    assert drafted.draft
    got = _images(photos, drafted, items)
    plans = []
    for i, seed in items:
        _, header = ds._open(i)
        with _seeded(seed):
            plans.append(drafted.prepare(header).draft)
    assert max(plans) > 1  # some samples were decoded at a reduced scale
    for t in compose.transforms:
        if hasattr(t, "interpolation"):
            t.interpolation = T.InterpolationMode.BILINEAR
    yardstick = _levels(_images(photos, compose, items), want)
    d = _levels(got, want)
    assert d.mean() <= 1.25 * yardstick.mean(), (d.mean(), yardstick.mean())
    assert d.max() <= 1.5 * yardstick.max() + 1, (d.max(), yardstick.max())


@pytest.mark.parametrize("resample", [Image.BICUBIC, Image.BILINEAR])
def test_device_resize_is_pils_resize(resample):
    """Up- and downscaling (PIL's pass order included), fractional boxes (the draft case),
    several sizes in one zero-padded batch, noise images (every rounding and clip shows)."""
    from cvl.data.augment import _resize

    rng = np.random.default_rng(1)
    cases = [((50, 40), (3.3, 2.0, 47.9, 39.0), (16, 16)), ((20, 30), None, (40, 24))]
    cases += [((97, 33), (10.5, 1.25, 90.0, 30.5), (16, 16)), ((16, 16), None, (16, 16))]
    cases += [((30, 20), None, (24, 40)), ((100, 80), None, (90, 60)), ((40, 100), None, (50, 30))]
    orders = set()
    for (w, h), box, (ow, oh) in cases:
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        want = np.asarray(Image.fromarray(a).resize((ow, oh), resample, box=box))
        box = box or (0, 0, w, h)
        sx, sy = (box[2] - box[0]) / ow, (box[3] - box[1]) / oh
        geom = [[box[1], sy, h, h - oh], [box[0], sx, w, w - ow]]
        geom = torch.tensor([geom], dtype=torch.float64)
        padded = torch.full((1, h + 5, w + 7, 3), 255, dtype=torch.uint8)  # must not leak in
        padded[0, :h, :w] = torch.from_numpy(a)
        first = bool(vertical_first(geom))
        orders.add(first)
        got = _resize(padded, geom, (oh, ow), resample, first)[0].permute(1, 2, 0).numpy()
        diff = np.abs(got - want)
        # PIL's own weights; its integer sums vs float32 ones: a near-tie may round the other
        # way (often with bilinear's round-number weights at round-number scales)
        share = 0.005 if resample == Image.BICUBIC else 0.05
        assert diff.max() <= 1 and (diff > 0).mean() < share, ((w, h), box, (ow, oh))
    assert orders == {False, True}
    w = resize_weights(torch.tensor([[0.0, 2.5, 10]], dtype=torch.float64), 4, 12)
    assert torch.allclose(w.sum(-1), torch.ones(1, 4)) and not w[..., 10:].any()


def test_flip_on_the_device_and_unrecognised_pipelines(photos):
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    compose = T.Compose(
        [
            T.RandomResizedCrop(48, scale=(0.5, 1.0), interpolation=T.InterpolationMode.BICUBIC),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(mean, std),
        ]
    )
    st = split_transform(compose, resize_on_device=True, draft=False)
    assert st.resize_on_device and st.flip_p == 0.5
    items = [(i, 7 + i) for i in range(len(PairDataset.from_shards(photos)))]
    ds = PairDataset.from_shards(photos, transform=st)
    batch = collate([ds[it] for it in items])
    assert 0 < int(batch["image_flip"].sum()) < len(items)
    d = _levels(device_images(batch, st, CPU), _images(photos, compose, items))
    assert d.max() <= 1.0 + 1e-3
    assert "image_geom" not in batch and "image_flip" not in batch  # consumed
    jitter = T.Compose([T.ColorJitter(0.4), *compose.transforms])
    no_center = T.Compose([T.Resize(32), T.ToTensor(), T.Normalize(mean, std)])
    nearest = T.Compose(
        [T.RandomResizedCrop(32, interpolation=T.InterpolationMode.NEAREST), T.ToTensor()]
    )
    for other in (jitter, no_center, nearest):
        assert split_transform(other) is None
    assert isinstance(train_transform(32, "openclip", "cpu"), SplitTransform)
    assert not train_transform(32, "openclip", "cpu").resize_on_device
    assert train_transform(32, "openclip", "cuda").resize_on_device  # a string: no GPU needed
    assert not train_transform(32, "ctp", "cuda").resize_on_device  # RandAugment


def test_split_batches_do_not_depend_on_workers_and_resume(photos):
    """Padded uint8 crops through the real DataLoader (shared memory in the worker)."""
    tok = HashTokenizer(64, 8)
    st = split_transform(image_transform(48, train=True), resize_on_device=True)
    ds = PairDataset.from_shards(photos, transform=st, tokenize=tok)
    batches = global_batches(len(ds), 5, seed=3, epoch=0)
    runs = []
    for workers in (0, 2):
        out = [device_images(b, st, CPU) for b in make_loader(ds, batches, num_workers=workers)]
        runs.append(out)
    resumed = [device_images(b, st, CPU) for b in make_loader(ds, batches[1:], num_workers=1)]
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1:], resumed))
    b = collate([ds[it] for it in batches[0]])
    h, w = (int(v) for v in b["image_geom"][:, :, 2].max(0).values)
    assert b["image"].shape == (5, h, w, 3) and b["image"].dtype == torch.uint8
    for k, (gy, gx) in enumerate(b["image_geom"][:, :, 2].long().tolist()):
        assert not b["image"][k, gy:].any() and not b["image"][k, :, gx:].any()  # zero padding


def test_default_workers_has_no_cap(monkeypatch):
    for cpus, procs, want in [(32, 1, 31), (128, 8, 15), (2, 1, 1), (1, 1, 1), (64, 4, 15)]:
        monkeypatch.setattr(
            "os.sched_getaffinity", lambda _pid, n=cpus: set(range(n)), raising=False
        )
        assert default_workers(procs) == want
    assert math.isfinite(default_workers())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_part_on_cuda_matches_the_cpu(photos, monkeypatch):
    """The batched part on a GPU (what a GPU run does): the CPU's values within a level,
    also under torch's deterministic mode (no scatter_, no host sync needed)."""
    st = split_transform(image_transform(224, train=True), resize_on_device=True)
    items = [(i, 3 + i) for i in range(len(PairDataset.from_shards(photos)))]
    ds = PairDataset.from_shards(photos, transform=st)
    batch = collate([ds[it] for it in items])
    cpu = st.finish(dict(batch), CPU)
    was = torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as cvl.device sets it
    torch.use_deterministic_algorithms(True)
    try:
        cuda = st.finish(dict(batch), torch.device("cuda")).cpu()
    finally:
        torch.use_deterministic_algorithms(was)
    d = _levels(cuda, cpu)
    assert d.max() <= 1.0 + 1e-3 and (d > 0.5).float().mean() < 1e-3
