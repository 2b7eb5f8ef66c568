"""Manifest round trip and precise validation errors."""

from __future__ import annotations

import copy

import pytest

from cvl.errors import CvlError
from cvl.streams.manifest import load_manifest, manifest_from_json, save_manifest, with_task_order

GOOD = {
    "schema": "cvl.stream/1",
    "name": "s",
    "source": "synthetic",
    "split_rule": "r",
    "seed": 3,
    "task_order": ["a", "b"],
    "tasks": {
        "a": {"train": {"shards": ["train/a/000000.tar"], "count": 5}, "description": "A"},
        "b": {"train": {"shards": ["train/b/000000.tar"], "count": 7}, "categories": ["x"]},
    },
    "eval_sets": {
        "test": {
            "kind": "pairs",
            "tasks": {"a": {"shards": ["eval/test/a/000000.tar"], "count": 2}},
        }
    },
}


def test_round_trip(tmp_path):
    m = manifest_from_json(copy.deepcopy(GOOD))
    save_manifest(m, tmp_path)
    m2 = load_manifest(tmp_path, check_files=False)
    assert m2.to_json()["tasks"] == m.to_json()["tasks"]
    assert m2.eval_sets["test"].tasks["a"].count == 2
    assert m2.train_shards("a")[0] == tmp_path.absolute() / "train/a/000000.tar"
    assert m2.fingerprint["counts"] == {"a": 5, "b": 7}
    assert with_task_order(m2, ["b", "a"]).task_order == ["b", "a"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("seed"), "top level: missing field 'seed'"),
        (lambda d: d.update(schema="cvl.stream/9"), "unsupported schema"),
        (lambda d: d.update(seed="x"), "seed: must be int"),
        (lambda d: d.update(task_order=["a", "zz"]), "task_order[1]: unknown task 'zz'"),
        (lambda d: d.update(task_order=["a", "a"]), "lists a task twice"),
        (
            lambda d: d["tasks"]["b"]["train"].update(count=0),
            "tasks['b'].train.count: must be a positive",
        ),
        (
            lambda d: d["tasks"]["a"]["train"].update(shards=["../x.tar"]),
            "escapes the stream folder",
        ),
        (lambda d: d["eval_sets"]["test"].update(kind="odd"), "eval_sets['test'].kind"),
        (
            lambda d: d["eval_sets"]["test"]["tasks"].update(q={"shards": [], "count": 0}),
            "unknown task 'q'",
        ),
        (lambda d: d.update(tasks={}), "at least one task"),
    ],
)
def test_validation_errors_name_the_field(mutate, message):
    d = copy.deepcopy(GOOD)
    mutate(d)
    with pytest.raises(CvlError) as e:
        manifest_from_json(d)
    assert message in str(e.value)


def test_missing_shard_and_folder(tmp_path):
    with pytest.raises(CvlError, match="not a stream folder"):
        load_manifest(tmp_path)
    save_manifest(manifest_from_json(copy.deepcopy(GOOD)), tmp_path)
    with pytest.raises(CvlError, match="task 'a': missing shard"):
        load_manifest(tmp_path)
