"""Shared fixtures: a small synthetic stream built once per session; CPU threads kept low;
tests marked `gpu` skipped where torch sees no CUDA device."""

from __future__ import annotations

import os

import pytest
import torch

from cvl.device import CUBLAS_WORKSPACE

torch.set_num_threads(int(os.environ.get("CVL_TEST_THREADS", "1")))
# Deterministic runs on a GPU need cuBLAS's fixed workspace from the first cuBLAS call of the
# process (cvl sets it when a command starts; here earlier tests may already have used CUDA).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


def pytest_collection_modifyitems(config, items):
    """Skip the `gpu` tests on a machine without CUDA (they run wherever torch sees a GPU)."""
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
