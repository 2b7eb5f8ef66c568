"""Shared fixtures: a small synthetic stream built once per session; CPU threads kept low;
tests marked `gpu` skipped where torch sees no CUDA device; `xdist_group` honoured under
`--dist loadgroup` whatever the pytest version (see `_group_for_xdist`)."""

from __future__ import annotations

import os

import pytest
import torch

from cvl.device import CUBLAS_WORKSPACE

torch.set_num_threads(int(os.environ.get("CVL_TEST_THREADS", "1")))
# Deterministic runs on a GPU need cuBLAS's fixed workspace from the first cuBLAS call of the
# process (cvl sets it when a command starts; here earlier tests may already have used CUDA).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook (see _group_for_xdist)
def pytest_collection_modifyitems(config, items):
    """Skip the `gpu` tests on a machine without CUDA (they run wherever torch sees a GPU)."""
    for item in items:  # the worker that launches the torchrun batch runs every test of it
        if item.get_closest_marker("torchrun_pair"):
            item.add_marker(pytest.mark.xdist_group("torchrun_batch"))
    _group_for_xdist(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def synth_stream(tmp_path_factory):
    """A 3-task synthetic stream (96 train pairs per task, 24 test, 12 val/query, 24 gallery).

    The disjoint layout (overlap 0): no shape or style shared between tasks."""
    from cvl.streams.synthetic import SynthSpec, build_synthetic

    out = tmp_path_factory.mktemp("streams") / "synth"
    spec = SynthSpec(
        tasks=3,
        per_task=96,
        test_per_task=24,
        val_per_task=12,
        query_per_task=12,
        gallery_per_task=24,
        overlap=0,
        seed=0,
    )
    build_synthetic(out, spec, progress=False)
    return out


@pytest.fixture(scope="session")
def torchrun_batch(request, synth_stream, tmp_path_factory):
    """The 2-process runs of every selected test marked `torchrun_pair`, in ONE torchrun
    launch (tests/test_distributed.py: launch_pairs)."""
    from test_distributed import launch_pairs, pair_key

    marks = {}
    for item in request.session.items:
        for mark in item.iter_markers("torchrun_pair"):
            marks.setdefault(pair_key(mark), mark)
    return launch_pairs(synth_stream, tmp_path_factory.mktemp("pairs"), marks)


@pytest.fixture
def pair_runs(request, torchrun_batch, synth_stream, tmp_path):
    """(1-process logs, 2-process logs, their final weights) for the test's
    `torchrun_pair` mark: the 2-process run from the batch, the 1-process run made here."""
    from test_distributed import pair_of

    mark = request.node.get_closest_marker("torchrun_pair")
    return pair_of(torchrun_batch, mark, synth_stream, tmp_path)


def _group_for_xdist(config, items) -> None:
    """Give a test marked `xdist_group(NAME)` the node id suffix `@NAME` that `--dist loadgroup`
    schedules by (one worker for the group: its module fixture is built once).

    pytest-xdist (3.8) writes the suffix to `Node._nodeid`, which pytest 9.2 no longer reads
    (the id lives in `Node._id`): the groups were silently ignored, and each worker built
    e.g. test_distributed.py's every-method torchrun fixture (~200 s) for itself."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default"))
            for m in item.iter_markers("xdist_group")
        }
        # already suffixed (a pytest whose node id xdist's hook could set), or not grouped
        if not names or item.nodeid.rfind("@") > item.nodeid.rfind("]"):
            continue
        item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(sorted(names))}")
