"""engine.offload_states / reload_states on CPU: NVMe files, real memory freed, bit-exact,
training continues as if nothing happened (the GPU half, pinned host memory, is the seed's test
and needs a GPU)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zoffload import OffloadStateTypeEnum

STATES = list(OffloadStateTypeEnum)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _engine(
    stage: int, aio: dict[str, Any] | None = None, **zero: Any
) -> tuple[zengine.Engine, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    if aio is not None:
        config["aio"] = aio
    engine, *_ = zengine.initialize(model=model, config=config)
    return engine, model


def _steps(engine: zengine.Engine, n: int, g: torch.Generator) -> list[float]:
    losses = []
    for _ in range(n):
        loss = engine(torch.randn(4, 1024, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class TestOffloadStates(DistributedTest):
    @pytest.mark.parametrize(
        ("world_size", "stage", "aio"),
        [
            (1, 1, None),
            (2, 1, None),
            (1, 3, None),
            (2, 3, None),
            # DeepSpeed's aio section: 4 requests of 256 KiB in flight instead of zoffload's own
            (2, 3, {"block_size": 262144, "queue_depth": 2, "thread_count": 2}),
        ],
    )
    def test_nvme_round_trip_frees_memory_and_training_goes_on(
        self, world_size: int, stage: int, aio: dict[str, Any] | None
    ) -> None:
        reference, _ = _engine(stage)
        expected = _steps(reference, 4, torch.Generator().manual_seed(5 + zcomm.get_rank()))
        engine, _ = _engine(stage, aio)
        if aio is not None:
            io = engine._offloaded.offloader.io
            assert (io.threads, io.chunk_bytes) == (4, 262144)
        data = torch.Generator().manual_seed(5 + zcomm.get_rank())
        first = _steps(engine, 2, data)
        held = {s: zengine._offload_states.state_tensors(engine, s) for s in STATES}
        before = {s: {k: t.clone() for k, t in ts.items()} for s, ts in held.items()}
        # a step leaves a large gradient buffer zeroed by handing its pages back (the Note on
        # returning memory on CPU): writing its zeros makes it resident, all of it to be freed
        for grads in held[OffloadStateTypeEnum.lp_grads].values():
            assert not bool(grads.any())
            grads.zero_()
        nbytes = sum(
            {
                id(t.untyped_storage()): t.untyped_storage().nbytes()
                for ts in held.values()
                for t in ts.values()
            }.values()
        )
        path = tempfile.mkdtemp(prefix=f"zengine-offload-{zcomm.get_rank()}-")
        try:
            rss = _rss()
            engine.offload_states(device="nvme", nvme_path=path)
            freed = rss - _rss()
            for state, tensors in held.items():
                assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values()), state
                assert zengine.get_state_devices(engine, state) == set()
            assert freed >= 0.9 * nbytes, (freed, nbytes)
            engine.reload_states()
        finally:
            shutil.rmtree(path)
        for state, tensors in held.items():
            assert zengine.get_state_devices(engine, state) <= {torch.device("cpu")}
            for name, tensor in tensors.items():
                assert torch.equal(tensor, before[state][name]), (state, name)
        assert first + _steps(engine, 2, data) == expected

    @pytest.mark.parametrize("world_size", [1])
    def test_include_and_errors(self, world_size: int) -> None:
        engine, _ = _engine(3)
        _steps(engine, 1, torch.Generator().manual_seed(0))
        engine.offload_states(include=["optim_states"], device="cpu")
        assert zengine.get_state_devices(engine, "optim_states") == {torch.device("cpu")}
        state = zengine._offload_states.state_tensors(engine, OffloadStateTypeEnum.optim_states)
        assert all(t.untyped_storage().nbytes() == 0 for t in state.values())
        lp = zengine._offload_states.state_tensors(engine, OffloadStateTypeEnum.lp_grads)
        assert all(t.untyped_storage().nbytes() > 0 for t in lp.values())
        engine.reload_states()
        with pytest.raises(ValueError, match="nvme_path"):
            engine.offload_states(device="nvme")
        with pytest.raises(ValueError, match="bogus"):
            engine.offload_states(include=["bogus"])

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_contiguous_grad_buffer_is_freed_and_given_back(self, world_size: int) -> None:
        """DeepSpeed's contiguous gradient buffer (kept on CPU when the config names
        contiguous_gradients; always on CUDA): offload frees it without copying, reload gives
        the memory back, training goes on as before."""
        state = OffloadStateTypeEnum.contiguous_grad_buffer
        reference, _ = _engine(3)
        expected = _steps(reference, 3, torch.Generator().manual_seed(5 + zcomm.get_rank()))
        assert zengine.get_state_devices(reference, state) == set()  # not kept by default on CPU
        engine, _ = _engine(3, contiguous_gradients=True)
        data = torch.Generator().manual_seed(5 + zcomm.get_rank())
        first = _steps(engine, 1, data)
        assert zengine.get_state_devices(engine, state) == {torch.device("cpu")}
        (buffer,) = zengine._offload_states.state_tensors(engine, state).values()
        engine.offload_states(include=[state], device="cpu")
        assert zengine.get_state_devices(engine, state) == set()
        assert buffer.untyped_storage().nbytes() == 0
        engine.reload_states()
        assert zengine.get_state_devices(engine, state) == {torch.device("cpu")}
        assert buffer.untyped_storage().nbytes() > 0
        assert first + _steps(engine, 2, data) == expected
