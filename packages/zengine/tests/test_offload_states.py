"""engine.offload_states / reload_states on CPU ([Note: offload_states' footprint]): NVMe frees
every byte the engine holds, reload gives back exactly the footprint before (nothing
materialised that was not resident, nothing left over, cycle after cycle), bit-exact, and
training goes on with the same losses; offloading to the host what is there already does
nothing. The GPU half (pinned host memory) is the seed's test and needs a GPU."""

from __future__ import annotations

import ctypes
import gc
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
import zoffload
from zcomm.testing import DistributedTest
from zengine._offload import trim_heap
from zengine._offload._states import state_tensors
from zoffload import OffloadStateTypeEnum

STATES = list(OffloadStateTypeEnum)
_PAGE = 4096
_libc = ctypes.CDLL(None)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _rss() -> int:
    """The process's resident memory, with glibc's free heap handed back first."""
    trim_heap()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _resident(storage: torch.UntypedStorage) -> int:
    """Bytes of `storage` whose pages are in memory now (mincore)."""
    if not storage.nbytes():
        return 0
    start = storage.data_ptr() // _PAGE * _PAGE
    pages = -(-(storage.data_ptr() + storage.nbytes() - start) // _PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert _libc.mincore(start, pages * _PAGE, vec) == 0
    return min(sum(b & 1 for b in vec.raw) * _PAGE, storage.nbytes())


def _zero_bytes(storage: torch.UntypedStorage, block: int = 1 << 16) -> int:
    """Bytes of `storage` in whole blocks of zeros: they may come back from NVMe unmapped
    (zoffload's [Note: zero pages]), so the process can be that much smaller after reload."""
    data = torch.empty(0, dtype=torch.uint8).set_(storage)
    whole = data.numel() // block
    return int((data[: whole * block].view(whole, block) == 0).all(dim=1).sum()) * block


def _storages() -> dict[int, torch.UntypedStorage]:
    """Every tensor storage a Python object in this process points at, but scalars (Adam's
    step counts, which no state type names) and empty ones."""
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes() > 64:
                found[storage._cdata] = storage
    return found


def _engine(
    stage: int, aio: dict[str, Any] | None = None, width: int = 1024, **zero: Any
) -> zengine.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(8)))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    if aio is not None:
        config["aio"] = aio
    engine, *_ = zengine.initialize(model=model, config=config)
    return engine


def _batches(width: int = 1024) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(5 + zcomm.get_rank())
    while True:
        yield torch.randn(4, width, generator=g)


def _steps(engine: zengine.Engine, n: int, data: Iterator[torch.Tensor]) -> list[float]:
    losses = []
    for _ in range(n):
        loss = engine(next(data)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _held(engine: zengine.Engine) -> dict[str, dict[str, torch.Tensor]]:
    return {s.value: state_tensors(engine, s) for s in STATES}


def _nvme_dir() -> str:
    return tempfile.mkdtemp(prefix=f"zengine-offload-{zcomm.get_rank()}-")


class TestOffloadStates(DistributedTest):
    @pytest.mark.parametrize(
        ("world_size", "stage", "options", "non_blocking"),
        [
            (1, 1, {}, False),
            (2, 1, {}, True),
            (1, 2, {"offload_optimizer": {"device": "cpu", "pin_memory": False}}, False),
            (2, 2, {}, False),
            (1, 3, {"offload_optimizer": {"device": "cpu"}}, True),
            # DeepSpeed's aio section: 4 requests of 256 KiB in flight instead of zoffload's own
            (2, 3, {"aio": {"block_size": 262144, "queue_depth": 2, "thread_count": 2}}, False),
        ],
    )
    def test_nvme_gives_back_everything_and_reload_restores_the_footprint(
        self, world_size: int, stage: int, options: dict[str, Any], non_blocking: bool
    ) -> None:
        options = dict(options)
        aio = options.pop("aio", None)
        gc.collect()
        outside = set(_storages())  # the harness's and earlier tests' tensors
        engine = _engine(stage, aio, **options)
        if aio is not None:
            io = engine._offloaded.offloader.io
            assert (io.threads, io.chunk_bytes) == (4, 262144)
        data = _batches()
        first = _steps(engine, 2, data)
        gc.collect()
        mine = {k: s for k, s in _storages().items() if k not in outside}
        nbytes = sum(s.nbytes() for s in mine.values())
        assert nbytes >= 32 << 20  # not a tiny or empty model
        # the engine's account agrees with every storage this process holds for it
        assert engine.memory_held()["total"] == {"cpu": nbytes}
        resident = sum(_resident(s) for s in mine.values())
        zeros = sum(_zero_bytes(s) for s in mine.values())
        before = {s: {k: t.clone() for k, t in ts.items()} for s, ts in _held(engine).items()}
        path = _nvme_dir()
        try:
            rss = _rss()
            engine.offload_states(device="nvme", nvme_path=path, non_blocking=non_blocking)
            if non_blocking:  # the files are written in the background: wait for them
                for handle in engine._offloaded.handles.values():
                    handle.wait()
            away = _rss()
            # at least 90% of the resident state bytes freed, and no storage left but scalars
            assert rss - away >= 0.9 * resident, (rss - away, resident)
            left = {k: s.nbytes() for k, s in _storages().items() if k in mine}
            assert not left, left
            held = engine.memory_held()
            assert held["total"] == {"nvme": nbytes}, held
            for state in STATES:
                assert zengine.get_state_devices(engine, state) == set(), state
            engine.reload_states(non_blocking=non_blocking)
            engine._offloaded.settle()  # what the engine's next call does first
            back = _rss()
        finally:
            shutil.rmtree(path)
        # nothing left over or materialised; smaller only by zero pages that were resident
        assert back - rss <= 0.02 * rss, (rss, back)
        assert rss - back <= zeros + 0.02 * rss, (rss, back, zeros)
        assert zoffload.default_pool().stats().blocks == 0  # no staging buffer kept
        assert engine.memory_held()["total"] == {"cpu": nbytes}
        for kind, tensors in _held(engine).items():
            assert zengine.get_state_devices(engine, kind) <= {torch.device("cpu")}
            for name, tensor in tensors.items():
                assert torch.equal(tensor, before[kind][name]), (kind, name)
        went_on = _steps(engine, 2, data)
        reference = _engine(stage, **options)
        assert first + went_on == _steps(reference, 4, _batches())

    @pytest.mark.parametrize("world_size", [1])
    def test_a_hundred_cycles_do_not_grow(self, world_size: int) -> None:
        engine = _engine(3, width=256)
        data = _batches(256)
        _steps(engine, 1, data)
        path = _nvme_dir()
        try:
            sizes = []
            for _ in range(100):
                engine.offload_states(device="nvme", nvme_path=path)
                engine.reload_states()
                sizes.append(_rss())
            held = engine.memory_held()
            _steps(engine, 1, data)
        finally:
            shutil.rmtree(path)
        assert max(sizes[10:]) - sizes[9] <= 1 << 20, sizes
        assert zoffload.default_pool().stats().blocks == 0
        assert held["total"]["cpu"] > 0
        assert "nvme" not in held["total"]

    @pytest.mark.parametrize("world_size", [1])
    def test_to_the_host_what_is_there_already_is_a_no_op(self, world_size: int) -> None:
        engine = _engine(3, width=256, contiguous_gradients=True)
        data = _batches(256)
        expected = _steps(_engine(3, width=256), 3, _batches(256))
        first = _steps(engine, 1, data)
        held = _held(engine)
        places = {
            s: {k: (t.data_ptr(), t.untyped_storage().nbytes()) for k, t in ts.items()}
            for s, ts in held.items()
            if s != "contiguous_grad_buffer"
        }
        regions = zoffload.default_pool().stats().regions_allocated
        engine.offload_states(device="cpu")
        assert zoffload.default_pool().stats().regions_allocated == regions  # no copy made
        for state, tensors in places.items():
            assert zengine.get_state_devices(engine, state) == {torch.device("cpu")}
            now = {k: (t.data_ptr(), t.untyped_storage().nbytes()) for k, t in held[state].items()}
            assert now == tensors, state
        # the gradient bucket is scratch space: freed wherever it is, as DeepSpeed does
        bucket = OffloadStateTypeEnum.contiguous_grad_buffer
        assert zengine.get_state_devices(engine, bucket) == set()
        assert engine.memory_held()[bucket.value] == {}
        engine.reload_states()
        assert zengine.get_state_devices(engine, bucket) == {torch.device("cpu")}
        assert first + _steps(engine, 2, data) == expected

    @pytest.mark.parametrize("world_size", [1])
    def test_calls_that_need_an_offloaded_state_are_refused(self, world_size: int) -> None:
        engine = _engine(1, width=256)
        data = _batches(256)
        _steps(engine, 1, data)
        path = _nvme_dir()
        try:
            engine.offload_states(include=["optim_states"], device="nvme", nvme_path=path)
            with torch.no_grad():
                engine(next(data))  # generation needs the parameters only
            loss = engine(next(data)).square().mean()
            with pytest.raises(zengine.UsageError, match="optim_states are offloaded"):
                engine.backward(loss)
            engine.reload_states(non_blocking=True)
            engine.backward(loss)  # waits for the reload
            engine.step()
            engine.offload_states(device="nvme", nvme_path=path)
            with pytest.raises(zengine.UsageError, match="lp_params are offloaded"):
                engine(next(data))
            with pytest.raises(zengine.UsageError, match="reload_states"):
                engine.step()
            with pytest.raises(zengine.UsageError, match="reload_states"):
                engine.save_checkpoint(path)
            engine.reload_states()
        finally:
            shutil.rmtree(path)
        _steps(engine, 1, data)
        with pytest.raises(ValueError, match="nvme_path"):
            engine.offload_states(device="nvme")
        with pytest.raises(ValueError, match="bogus"):
            engine.offload_states(include=["bogus"])

    @pytest.mark.parametrize(("world_size", "stage"), [(2, 1), (2, 2)])
    def test_gradients_between_backward_and_step(self, world_size: int, stage: int) -> None:
        """DeepSpeed's ZeRO-1/2 gradient case: lp_grads offloaded after backward, before the
        step, come back bit-exact and the step is the same."""
        expected = _steps(_engine(stage, width=256), 3, _batches(256))
        engine = _engine(stage, width=256)
        data = _batches(256)
        losses = _steps(engine, 1, data)
        loss = engine(next(data)).square().mean()
        engine.backward(loss)
        grads = {k: t.clone() for k, t in _held(engine)["lp_grads"].items()}
        assert any(bool(t.any()) for t in grads.values())
        path = _nvme_dir()
        try:
            engine.offload_states(include=["lp_grads"], device="nvme", nvme_path=path)
            assert zengine.get_state_devices(engine, "lp_grads") == set()
            engine.reload_states()
        finally:
            shutil.rmtree(path)
        for name, tensor in _held(engine)["lp_grads"].items():
            assert torch.equal(tensor, grads[name]), name
        engine.step()
        losses.append(loss.item())
        assert losses + _steps(engine, 1, data) == expected

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_contiguous_grad_buffer_is_freed_and_given_back(self, world_size: int) -> None:
        """DeepSpeed's contiguous gradient buffer (kept on CPU when the config names
        contiguous_gradients; always on CUDA): offload frees it without copying, reload gives
        the memory back, training goes on as before."""
        state = OffloadStateTypeEnum.contiguous_grad_buffer
        reference = _engine(3)
        expected = _steps(reference, 3, _batches())
        assert zengine.get_state_devices(reference, state) == set()  # not kept by default on CPU
        engine = _engine(3, contiguous_gradients=True)
        data = _batches()
        first = _steps(engine, 1, data)
        assert zengine.get_state_devices(engine, state) == {torch.device("cpu")}
        (buffer,) = state_tensors(engine, state).values()
        engine.offload_states(include=[state], device="cpu")
        assert zengine.get_state_devices(engine, state) == set()
        assert buffer.untyped_storage().nbytes() == 0
        engine.reload_states()
        assert zengine.get_state_devices(engine, state) == {torch.device("cpu")}
        assert buffer.untyped_storage().nbytes() > 0
        assert first + _steps(engine, 2, data) == expected

    @pytest.mark.parametrize("world_size", [2])
    def test_memory_held_by_a_forward_only_engine(self, world_size: int) -> None:
        """An engine without an optimizer (a model served at ZeRO-3) holds its shards only."""
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = zengine.initialize(model=model, config=config)
        with torch.no_grad():
            engine(torch.randn(2, 256))
        held = engine.memory_held()
        shards = {
            u.shard.untyped_storage()._cdata: u.shard.nbytes for u in engine.partitioned.units
        }
        assert held["lp_params"] == held["total"] == {"cpu": sum(shards.values())}
        assert sum(shards.values()) >= 4 * 256 * 257 * 4 // world_size
        assert all(held[s.value] == {} for s in STATES if s.value != "lp_params")
