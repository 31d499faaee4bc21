"""The accelerator: CPU behaviour here, CUDA under the `gpu` mark; import stays lean."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU accelerator")
def test_cpu_accelerator() -> None:
    acc = zcomm.get_accelerator()
    assert acc is zcomm.get_accelerator()
    assert acc.device_name() == "cpu"
    assert acc.device_name(0) == "cpu:0"
    assert acc.current_device_name() == "cpu"
    assert acc.device() == torch.device("cpu", 0)
    assert acc.device_count() == int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    assert acc.random() is torch.random
    assert acc.is_available()
    assert acc.is_synchronized_device()
    assert acc.communication_backend_name() == "gloo"
    assert not acc.is_fp16_supported()
    assert acc.is_bf16_supported()
    assert acc.memory_allocated() > 0
    assert acc.max_memory_allocated() >= acc.memory_allocated() // 2
    t = torch.ones(4)
    assert acc.pin_memory(t) is t
    assert not acc.is_pinned(t)
    assert acc.on_accelerator(t)
    acc.empty_cache()
    acc.synchronize()
    acc.reset_peak_memory_stats()
    acc.set_device(0)
    acc.manual_seed(0)
    with acc.range("region"):
        pass
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16]
    assert 0 < acc.available_memory() <= acc.total_memory()
    assert acc.memory_reserved() > 0
    assert acc.max_memory_reserved() >= acc.memory_reserved() // 2


def test_rng_state_round_trip() -> None:
    """DeepSpeed's accelerator RNG calls (activation checkpointing and its tests fork the
    generator with them)."""
    acc = zcomm.get_accelerator()
    acc.manual_seed_all(7)
    assert acc.initial_seed() == 7
    state = acc.get_rng_state()
    first = torch.rand(3, device=acc.device())
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3, device=acc.device()), first)
    assert isinstance(acc.default_generator(0), torch.Generator)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU accelerator")
def test_cpu_streams_and_events_are_no_ops_that_still_time() -> None:
    acc = zcomm.get_accelerator()
    stream = acc.Stream()
    with acc.stream(stream):
        start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
        start.record()
        end.record()
    stream.wait_stream(acc.current_stream())
    stream.wait_event(end)
    stream.synchronize()
    acc.default_stream().synchronize()
    assert end.query()
    assert stream.query()
    assert start.elapsed_time(end) >= 0
    with pytest.raises(RuntimeError, match="both events must have been recorded"):
        acc.Event().elapsed_time(end)


def test_bad_device_type_is_named() -> None:
    with pytest.raises(ValueError, match=r"device_type=\.\.\.\): expected 'cuda' or 'cpu'"):
        zcomm.Accelerator("tpu")


_LEAN = """
import sys, torch, zcomm, zcomm.topology, zcomm.testing
assert not torch.cuda.is_initialized(), "importing zcomm initialized CUDA"
zcomm.get_accelerator()
assert not torch.cuda.is_initialized(), "get_accelerator() initialized CUDA"
assert "pytest" not in sys.modules, "importing zcomm imported pytest"
zcomm.init_distributed()  # plain `python`: the embedded world of one
zcomm.enable_comm_accounting()
assert (zcomm.get_rank(), zcomm.get_world_size()) == (0, 1)
print("lean ok")
"""


def test_import_does_not_initialize_cuda() -> None:
    # In a fresh interpreter, as torchao's test_lean_import does.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    done = subprocess.run(
        [sys.executable, "-c", _LEAN], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "lean ok" in done.stdout


def test_bad_forced_accelerator_is_named() -> None:
    env = dict(os.environ, ZCOMM_ACCELERATOR="tpu")
    code = "import zcomm; zcomm.get_accelerator()"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode != 0
    assert "ZCOMM_ACCELERATOR: expected 'cpu' or 'cuda', got 'tpu'" in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestCuda(DistributedTest):
    world_size = 1

    def test_nccl_world_of_one_on_the_gpu(self) -> None:
        import torch.distributed as dist

        acc = zcomm.get_accelerator()
        assert acc.device_name() == "cuda"
        assert acc.communication_backend_name() == "nccl"
        assert dist.get_backend() == "nccl"
        assert acc.is_fp16_supported()
        t = torch.ones(4, device=acc.current_device_name())
        zcomm.all_reduce(t)
        before = acc.memory_allocated()
        big = torch.empty(1 << 20, device="cuda")
        assert acc.memory_allocated() >= before + big.numel() * 4
        assert acc.max_memory_allocated() >= acc.memory_allocated()
        assert acc.pin_memory(torch.ones(2)).is_pinned()
        stream = acc.Stream()
        with acc.stream(stream):
            t.mul_(2)
        acc.current_stream().wait_stream(stream)
        acc.synchronize()
        assert t.tolist() == [2.0] * 4

    def test_host_tensors_on_nccl_go_through_the_device(self) -> None:
        # [Note: host tensors on NCCL]: a host tensor is copied to this rank's GPU and back
        # (test_staged.py checks the copying over gloo); a device tensor goes as it is
        from zcomm import _collectives

        here = torch.device("cuda", torch.cuda.current_device())
        assert _collectives._staging_device(None, [torch.ones(2)]) == here
        assert _collectives._staging_device(None, [torch.ones(2, device=here)]) is None
        t = torch.arange(4.0)
        handle = _collectives._staged(
            "all_reduce",
            None,
            (t,),
            (0,),
            lambda c: zcomm.all_reduce(c[0].mul_(3)),  # what the collective wrote: tripled
            async_op=True,
        )
        assert handle is not None
        handle.wait()
        assert t.tolist() == [0.0, 3.0, 6.0, 9.0]


class TestDeviceCount(DistributedTest):
    @pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU accelerator")
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_one_cpu_device_per_local_process(self, world_size: int) -> None:
        # DeepSpeed's CPU accelerator counts LOCAL_SIZE devices; its test helpers assert that
        # the world fits the devices
        assert zcomm.get_accelerator().device_count() == zcomm.get_world_size()
