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
