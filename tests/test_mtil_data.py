"""Classification datasets as tasks: every torchvision layout the builder reads (tiny fake
trees), the image-folder layout, the ZSCL split, few-shot selection, and a whole build with a
missing class, a missing file and a corrupt image."""

from __future__ import annotations

import json

import pytest
import torch
from cls_helpers import corrupt, image, image_folders, tv_tree

from cvl.errors import CvlError
from cvl.streams.classification import ORDER_I, ORDER_II, PROTOCOLS, build_classification, few_shot
from cvl.streams.cls_layouts import SPECS, read_dataset, zscl_split
from cvl.streams.pipeline import BuildOptions


@pytest.mark.parametrize("name", list(SPECS))
def test_torchvision_layout_is_read_like_torchvision(name, tmp_path):
    """Each dataset's torchvision tree: the class names (ZSCL's: hand-written lists, or the
    dataset's labels with _ as a space) in label order, the code's train/test split."""
    want = tv_tree(tmp_path, name)
    task, lst = read_dataset(tmp_path, name)
    assert task == name and lst.layout == "torchvision"
    assert lst.names == want["classes"]
    n = {s: sum(x.split == s for x in lst.samples) for s in ("train", "test")}
    assert n == {"train": want["train"], "test": want["test"]}
    assert all(0 <= x.label < len(lst.names) for x in lst.samples)
    assert all((x.path is None) != (x.data is None) for x in lst.samples)


def test_torchvision_labels_follow_the_split_files(tmp_path):
    """Labels come from the annotation files (not the folder order): Flowers' 1-based
    imagelabels (label 102 -> the last name), Pets' class ids, Cars' 1-based classes."""
    tv_tree(tmp_path, "flowers")
    _, lst = read_dataset(tmp_path, "flowers")
    assert [s.label for s in lst.samples] == [0, 1, 101, 0]
    assert lst.names[101] == "blackberry lily"
    tv_tree(tmp_path, "stanford_cars")
    _, cars = read_dataset(tmp_path, "cars")
    assert [(s.split, s.label) for s in cars.samples] == [("train", 0), ("train", 1), ("test", 1)]
    tv_tree(tmp_path, "oxford_pet")
    _, pets = read_dataset(tmp_path, "OxfordPet")
    assert [s.label for s in pets.samples] == [0, 1, 0]


def test_zscl_split_is_torch_random_split_with_seed_42():
    """The code's split_dataset: random_split(ds, [int(0.8 n), n - int(0.8 n)], Generator(42))."""
    n = 37
    a, b = torch.utils.data.random_split(
        range(n), [int(0.8 * n), n - int(0.8 * n)], generator=torch.Generator().manual_seed(42)
    )
    tr, te = zscl_split(n)
    assert tr == list(a.indices) and te == list(b.indices)
    assert len(tr) == 29 and sorted(tr + te) == list(range(n))


def test_missing_split_file_entries_are_counted_not_guessed(tmp_path):
    tv_tree(tmp_path, "aircraft")
    d = tmp_path / "fgvc-aircraft-2013b" / "data"
    (d / "images_variant_train.txt").write_text("1 707-320\n2 F/A-18\n3 A300B4\n99 A300B4\n")
    _, lst = read_dataset(tmp_path, "aircraft")
    assert sum(s.split == "train" for s in lst.samples) == 3
    assert lst.missing == [str(d / "images" / "99.jpg")]


def test_image_folders_layout_and_class_matching(tmp_path):
    """NAME/{train,test}/CLASS: any dataset (folder names are the classes, _ as a space);
    MTIL datasets with their own class lists match folders by key or name; an unknown folder
    is an error; Caltech-101 / EuroSAT / SUN397 also read as one pool split like the code."""
    image_folders(tmp_path, "mine", {"red_car": (2, 1), "boat": (1, 1)})
    task, lst = read_dataset(tmp_path, "mine")
    assert (task, lst.layout, lst.names) == ("mine", "image-folder", ["boat", "red car"])
    image_folders(tmp_path, "EuroSAT", {"AnnualCrop": (1, 1), "lake_or_sea": (1, 1)})
    _, eu = read_dataset(tmp_path, "eurosat")
    assert eu.names[0] == "annual crop land" and len(eu.names) == 10
    assert sorted({s.label for s in eu.samples}) == [0, 9]  # by key, and by (normalised) name
    image_folders(tmp_path, "mnist", {"7": (1, 1), "nope": (1, 1)})
    with pytest.raises(CvlError, match="class folder 'nope' is not one of its 10 classes"):
        read_dataset(tmp_path, "mnist")
    for i in range(5):
        image(tmp_path / "caltech101" / "Faces" / f"{i}.jpg")
    _, cal = read_dataset(tmp_path, "Caltech101")
    assert [s.split for s in cal.samples].count("test") == 1  # 5 - int(0.8 * 5)
    assert cal.names[0] == "off-center face"
    image(tmp_path / "pool" / "a" / "0.jpg")  # a pool is only for the code's split datasets
    with pytest.raises(CvlError, match="expected .*/train/CLASS/"):
        read_dataset(tmp_path, "pool")
    image(tmp_path / "half" / "train" / "a" / "0.jpg")
    with pytest.raises(CvlError, match="has train/ but no test/"):
        read_dataset(tmp_path, "half")
    with pytest.raises(CvlError, match="sun397: not found"):
        read_dataset(tmp_path, "sun397")


def test_few_shot_keeps_k_per_class_seeded(tmp_path):
    image_folders(tmp_path, "fs", {"a": (7, 2), "b": (3, 2)})
    _, lst = read_dataset(tmp_path, "fs")
    left, short = few_shot(lst, 5, seed=0, task="fs")
    per = {y: [s.path for s in lst.samples if s.split == "train" and s.label == y] for y in (0, 1)}
    assert (len(per[0]), len(per[1]), left, short) == (5, 3, 2, 1)
    assert sum(s.split == "test" for s in lst.samples) == 4  # test sets untouched
    _, again = read_dataset(tmp_path, "fs")
    few_shot(again, 5, seed=0, task="fs")
    assert [s.path for s in again.samples] == [s.path for s in lst.samples]  # same seed
    _, other = read_dataset(tmp_path, "fs")
    few_shot(other, 5, seed=1, task="fs")
    assert [s.path for s in other.samples] != [s.path for s in lst.samples]


def test_protocol_presets():
    assert PROTOCOLS["mtil"].datasets == tuple(ORDER_I) and len(ORDER_I) == 11
    assert ORDER_II == [
        "stanford_cars",
        "food",
        "mnist",
        "oxford_pet",
        "flowers",
        "sun397",
        "aircraft",
        "caltech101",
        "dtd",
        "eurosat",
        "cifar100",
    ]
    assert PROTOCOLS["mtil-fs"].shots == 5
    x = PROTOCOLS["x-tail"]
    assert x.shots == 16 and "cifar100" not in x.datasets and len(x.datasets) == 10
    assert x.union_templates == ("a photo of a {}.",)


def _opts(out, **kw):
    return BuildOptions(out=out, progress=False, log=lambda m: None, **kw)


def test_build_both_layouts_with_a_corrupt_image_and_a_missing_file(tmp_path):
    """MNIST (torchvision IDX files) + an image-folder dataset: one task each, captions = the
    first template, categories TASK/CLASS in label order, a class map over both tasks with the
    class names as prompts, each task's templates; the corrupt image and the missing listed
    file are counted in build_report.json, nothing guessed."""
    data = tmp_path / "data"
    tv_tree(data, "mnist")
    tv_tree(data, "dtd")
    (data / "dtd" / "dtd" / "images" / "bumpy" / "bumpy_1.jpg").unlink()  # listed, not there
    image_folders(data, "shapes", {"circle": (2, 1), "square_big": (2, 1)})
    corrupt(data / "shapes" / "train" / "circle" / "9.jpg")
    (data / "dtd" / "dtd" / "labels" / "train1.txt").write_text(
        "banded/banded_1.jpg\nbumpy/bumpy_1.jpg\nbumpy/bumpy_2.jpg\n"
    )
    m = build_classification(
        data, ["mnist", "shapes", "dtd"], _opts(tmp_path / "s"), templates="a {} shape"
    )
    assert m.task_order == ["mnist", "shapes", "dtd"]
    assert m.tasks["shapes"].categories == ["shapes/circle", "shapes/square big"]
    assert m.tasks["mnist"].extra["templates"] == ['a photo of the number: "{}".']
    assert m.tasks["shapes"].extra["templates"] == ["a {} shape"]
    cm = m.class_map
    assert cm["names"][:2] == ["mnist/0 - zero", "mnist/1 - one"] and len(cm["names"]) == 14
    assert cm["prompts"][10:12] == ["circle", "square big"] and cm["task_of"][10] == "shapes"
    rep = json.loads((tmp_path / "s" / "build_report.json").read_text())
    assert rep["dropped"] == {"missing_file": 1, "bad_image": 1}
    assert rep["datasets"]["mnist"]["layout"] == "torchvision"
    from cvl.data.reader import PairDataset

    ds = PairDataset.from_shards(m.train_shards("shapes"))
    caps = sorted(ds.read_raw(i)[1] for i in range(len(ds)))
    assert caps == ["a circle shape", "a circle shape", "a square big shape", "a square big shape"]
    meta = ds.read_raw(0)[2]
    assert meta["category"].startswith("shapes/") and meta["label"] in (0, 1)
    assert m.eval_sets["test"].tasks["mnist"].count == 4


def test_a_class_without_training_images_is_a_one_line_error(tmp_path):
    data = tmp_path / "data"
    image_folders(data, "a", {"x": (1, 1), "y": (0, 1)})  # y: a test folder, no train images
    with pytest.raises(CvlError, match=r"a: class 'y' \(key 'y'\) has no training image"):
        build_classification(data, ["a"], _opts(tmp_path / "s"))
    assert not (tmp_path / "s").exists()
    data2 = tmp_path / "data2"
    image_folders(data2, "b", {"x": (1, 1), "z": (1, 1)})
    corrupt(data2 / "b" / "train" / "z" / "0.jpg")  # z's only training image is unreadable
    with pytest.raises(CvlError, match="b: class 'z' has no readable training image left"):
        build_classification(data2, ["b"], _opts(tmp_path / "s2"))
    assert not (tmp_path / "s2").exists()


def test_protocol_command_builds_x_tail_shape(tmp_path):
    """`cvl build-stream protocol x-tail` goes to the classification builder (here on a tree
    that lacks the datasets: the first one is named)."""
    from cvl.streams.protocols import build_protocol

    with pytest.raises(CvlError, match="aircraft: not found"):
        build_protocol("x-tail", tmp_path / "out", _opts(tmp_path / "out"), data=tmp_path)
    with pytest.raises(CvlError, match="pass --data"):
        build_protocol("mtil", tmp_path / "out", _opts(tmp_path / "out"))


def test_dataset_names_are_names_not_paths(tmp_path, capsys):
    """`--datasets shapes/../colors` would read colors/ as 'shapes_.._colors', `../x` a folder
    outside --data: a dataset is a name, refused with one line before anything is read."""
    from cvl.cli import main

    data = tmp_path / "data"
    for name in ("shapes", "colors"):
        image_folders(data, name, {"a": (1, 1), "b": (1, 1)})
    image_folders(tmp_path, "x", {"a": (1, 1), "b": (1, 1)})  # beside --data, not in it
    for bad in ("shapes/../colors", "../x", str(data / "colors"), "..", "~", "a\\b"):
        with pytest.raises(CvlError, match="a dataset is a name"):
            build_classification(data, ["shapes", bad], _opts(tmp_path / "s"))
        assert not (tmp_path / "s").exists()
    argv = ["build-stream", "classification", "--data", str(data), "--out", str(tmp_path / "s")]
    assert main([*argv, "--datasets", "shapes,../x", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --datasets '../x': a dataset is a name") and "\n" not in err
    assert build_classification(data, ["shapes", "colors"], _opts(tmp_path / "s")).task_order == [
        "shapes",
        "colors",
    ]


def test_classes_of_two_tasks_with_one_prompt_are_one_class_of_the_union(tmp_path):
    """X-TAIL's all-classes space with one template: Caltech-101's and Flowers-102's
    'sunflower' have one prompt, so neither could ever be right (a tie counts against). The
    build finds them (class_map.same_prompt, a warning naming them) and ZS-all keeps one of
    them: an image of either, embedded on the shared text, is right (100%, was 0%)."""
    from types import SimpleNamespace

    from cvl.classtext import same_prompt
    from cvl.evaluation.checkpoint import _zs

    data = tmp_path / "data"
    image_folders(data, "a", {"sunflower": (1, 1), "rose": (1, 1)})
    image_folders(data, "b", {"sunflower": (1, 1), "lotus": (1, 1)})
    m = build_classification(
        data, ["a", "b"], _opts(tmp_path / "s"), union_templates=["a photo of a {}."]
    )
    assert m.class_map["same_prompt"] == {"b/sunflower": "a/sunflower"}
    from cvl.streams.manifest import load_manifest

    assert load_manifest(tmp_path / "s").class_map["same_prompt"] == m.class_map["same_prompt"]
    rep = json.loads((tmp_path / "s" / "build_report.json").read_text())
    assert any("b/sunflower = a/sunflower" in w for w in rep["warnings"])
    # each task's own templates that differ: different prompts, nothing merged
    assert same_prompt(["a/x", "b/x"], ["x", "x"], [("a {}.",), ("a {}, a flower.",)]) == {}
    names = ["a/rose", "a/sunflower", "b/lotus", "b/sunflower"]
    feats = dict(zip(names, torch.eye(4)[[0, 1, 2, 1]]))  # the two sunflowers: one text
    e = SimpleNamespace(
        image_features=torch.eye(4)[[1, 1]], categories=["a/sunflower", "b/sunflower"]
    )
    z = _zs(e, feats, names, m.class_map["same_prompt"])
    assert (z["top1"], z["n_classes"]) == (100.0, 3)
    assert _zs(e, feats, names)["top1"] == 0.0  # without it: a tie, never right
