"""`cvl.device`: device choice (auto picks CUDA when torch sees it) and the determinism switch."""

from __future__ import annotations

import pytest
import torch

from cvl import device as dev
from cvl.errors import CvlError


def _fake_cuda(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_auto_picks_cuda_when_available(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    assert dev.resolve_device("auto") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert dev.resolve_device("cpu") == torch.device("cpu")


def test_auto_is_cpu_without_cuda(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    assert dev.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(CvlError, match="no CUDA device"):
        dev.resolve_device("cuda")


@pytest.mark.parametrize(
    "spec, msg", [("cuda:2", "has 2 CUDA"), ("cuda:x", "cuda:N"), ("tpu", "expected")]
)
def test_bad_device_specs_are_one_line_errors(monkeypatch, spec, msg):
    _fake_cuda(monkeypatch, 2)
    with pytest.raises(CvlError, match=msg):
        dev.resolve_device(spec)


def test_single_process_runner_has_no_accelerator(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _fake_cuda(monkeypatch, 1)
    acc, d = dev.model_runner("auto")
    assert acc is None and d == torch.device("cuda", 0)


def test_deterministic_default_is_per_device():
    assert dev.deterministic_default("cpu") is True
    assert dev.deterministic_default("cuda:0") is False


def test_set_deterministic_switches_torch_and_names_the_op(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        dev.set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == dev.CUBLAS_WORKSPACE
        with pytest.raises(
            RuntimeError
        ) as e:  # put_ without accumulate has no deterministic kernel
            torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
        assert dev.nondeterministic_op(e.value) == "put_"
    finally:
        dev.set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert dev.nondeterministic_op(RuntimeError("CUDA out of memory")) is None


def test_apply_determinism_resolves_the_default_per_device():
    try:
        assert dev.apply_determinism(None, "cpu") is True
        assert torch.are_deterministic_algorithms_enabled()
        assert dev.apply_determinism(None, "cuda:0") is False
        assert not torch.are_deterministic_algorithms_enabled()
        assert dev.apply_determinism(True, "cuda:0") is True
    finally:
        dev.set_deterministic(False)
