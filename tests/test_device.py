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


def _launch(monkeypatch, world: int, local_rank: int = 0) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))


def test_more_processes_than_gpus_is_a_one_line_error(monkeypatch):
    """Two ranks on one GPU (NCCL: "Duplicate GPU detected") are refused up front, saying to
    launch fewer processes or use --device cpu; the CPU path (gloo) stays open."""
    _fake_cuda(monkeypatch, 1)
    _launch(monkeypatch, 2, local_rank=1)
    for run in (dev.check_processes_per_gpu, dev.launch_device, dev.model_runner):
        with pytest.raises(CvlError, match=r"launches 2 processes but has 1 GPU.*--device cpu"):
            run("auto")
    assert dev.launch_device("cpu") == torch.device("cpu")
    dev.check_processes_per_gpu("cpu")
    _fake_cuda(monkeypatch, 2)
    assert dev.launch_device("auto") == torch.device("cuda", 1)  # one GPU per process
    with pytest.raises(CvlError, match="launcher's device"):
        dev.launch_device("cuda:1")
    _fake_cuda(monkeypatch, 0)
    assert dev.launch_device("auto") == torch.device("cpu")
    with pytest.raises(CvlError, match="no CUDA device"):
        dev.launch_device("cuda")


def test_accelerator_is_fresh_per_call_in_one_process(monkeypatch):
    """Accelerate keeps one state per process: without a reset a second command in the same
    process (tests, dist_many, benchmarks) would keep the first one's precision and device."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    a = dev.accelerator("cpu", mixed_precision="no")
    assert a.device == torch.device("cpu") and a.mixed_precision == "no"
    b = dev.accelerator("cpu", mixed_precision="bf16")
    assert b.device == torch.device("cpu") and b.mixed_precision == "bf16"


def test_nondeterministic_op_stops_with_one_line():
    try:
        dev.set_deterministic(True)
        with pytest.raises(CvlError) as e, dev.nondeterministic_ops_stop("cpu"):
            torch.zeros(4).put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("put_ has no deterministic implementation")
        assert "--no-deterministic" in msg
        with pytest.raises(RuntimeError, match="other"), dev.nondeterministic_ops_stop("cpu"):
            raise RuntimeError("some other failure")
    finally:
        dev.set_deterministic(False)


@pytest.mark.gpu
def test_step_seeding_covers_the_cuda_generators():
    """The loop's per-step seeding (`seed_torch`) fixes CUDA draws (dropout, randn on the
    device) too, not only the CPU generator's."""
    from cvl.train.optim import seed_torch

    cuda = torch.device("cuda", torch.cuda.current_device())
    seed_torch(5, cuda)
    a = torch.rand(8, device=cuda)
    torch.rand(8, device=cuda)  # the stream moves on...
    seed_torch(5, cuda)
    assert torch.equal(torch.rand(8, device=cuda), a)  # ...and the seed brings it back
    seed_torch(6, cuda)
    assert not torch.equal(torch.rand(8, device=cuda), a)


def test_gpu_count_check_uses_this_nodes_processes(monkeypatch):
    """The check counts this node's processes (LOCAL_WORLD_SIZE, else the local rank), never
    the whole world: 2 nodes × 1 process on 1-GPU nodes are fine."""
    _fake_cuda(monkeypatch, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    dev.check_processes_per_gpu("auto")  # rank 0 of its node: one GPU is enough
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(CvlError, match="launches 2 processes but has 1 GPU"):
        dev.check_processes_per_gpu("auto")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    dev.check_processes_per_gpu("auto")


def test_exact_float32_switches_tf32_off_in_matmuls_and_convolutions_and_restores():
    """Evaluation in float32 is full float32 on a GPU: TF32 off for matmuls and for cuDNN's
    convolutions (torch's default turns it on there), the previous settings back afterwards,
    also after an error; `cvl eval --precision no` embeds inside it."""
    from cvl.evaluation.embed import autocast

    prev = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    try:
        with pytest.raises(RuntimeError), dev.exact_float32():
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cudnn.allow_tf32 is False
            raise RuntimeError
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.allow_tf32 is True
        with autocast("cpu", "no"):
            assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.set_float32_matmul_precision(prev[0])
        torch.backends.cudnn.allow_tf32 = prev[1]
