"""ZeRO-Offload and ZeRO-Infinity on CPU: ``offload_optimizer`` (host, NVMe) and
``offload_param`` (host) train exactly as the plain run, and NVMe really holds the state
between steps (on a GPU the same paths also move the bytes off the device)."""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

import zcomm
import zengine
import zoffload
from zcomm.testing import DistributedTest

from ._helpers import TinyGPT, global_batches, plain_losses

LR = 1e-2


def _config(stage: int, zero: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16, **zero},
        **extra,
    }


def _train(engine: zengine.Engine, data: list[torch.Tensor]) -> list[float]:
    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    losses = []
    for tokens in data:
        loss = engine(tokens.view(world, -1, tokens.shape[-1])[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float()
        zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)
        losses.append(total.item())
    return losses


def _engine(stage: int, zero: dict[str, Any], **extra: Any) -> tuple[zengine.Engine, TinyGPT]:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    engine, *_ = zengine.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, zero, **extra)
    )
    return engine, reference


def _swapped_out(zero: Any) -> bool:
    return bool(zero.swapper.swapped_out)


def _folder() -> Path:
    """A per-rank scratch folder (removed by the caller)."""
    return Path(tempfile.mkdtemp(prefix=f"zengine-nvme-{zcomm.get_rank()}-"))


class TestOffloadOptimizer(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [1, 2, 3])
    @pytest.mark.parametrize("device", ["cpu", "nvme"])
    def test_losses_match_plain_pytorch(self, world_size: int, stage: int, device: str) -> None:
        folder = _folder()
        try:
            offload = {"device": device, "nvme_path": str(folder)}
            engine, reference = _engine(stage, {"offload_optimizer": offload})
            data = global_batches(6, 2 * world_size)
            losses = _train(engine, data)
            expected = plain_losses(reference, data, lr=LR)
            torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
            engine.destroy()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("stage", [2, 3])
    def test_nvme_holds_masters_and_state_between_steps(self, world_size: int, stage: int) -> None:
        folder = _folder()
        try:
            offload = {"device": "nvme", "nvme_path": str(folder)}
            engine, _ = _engine(stage, {"offload_optimizer": offload})
            data = global_batches(3, 2 * world_size)
            _train(engine, data)
            zero = engine.optimizer
            assert zero.swapper is not None
            assert _swapped_out(zero)
            # the optimizer's tensors are the same objects, emptied once the write is done
            zero.swapper.wait()
            stepped = zero.stepped_tensors()
            states = [v for t in stepped for v in zero.state[t].values() if v.dim() > 0]
            expected = sum(t.numel() * t.element_size() for t in [*stepped, *states])
            assert all(t.untyped_storage().nbytes() == 0 for t in [*stepped, *states])
            on_disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            assert on_disk >= expected
            # the gradient partitions stay in memory: backward adds to them
            assert zero.grad_partitions_flat_buffer.untyped_storage().nbytes() > 0
            # reading the state brings it back, bit-exact with what the step wrote
            param = next(iter(engine.module.parameters()))
            exp_avg = zengine.safe_get_local_optimizer_state(param, "exp_avg")
            assert exp_avg is not None
            assert torch.isfinite(exp_avg).all()
            assert not _swapped_out(zero)
            assert all(t.untyped_storage().nbytes() > 0 for t in stepped)
            engine.destroy()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @pytest.mark.parametrize("world_size", [2])
    def test_nvme_with_accumulation_and_clipping(self, world_size: int) -> None:
        folder = _folder()
        try:
            offload = {"device": "nvme", "nvme_path": str(folder)}
            extra = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5}
            # the parameters too: their shards are held through the backward before a step
            zero = {"offload_optimizer": offload, "offload_param": offload}
            engine, reference = _engine(3, zero, **extra)
            plain, _ = _engine(3, {}, **extra)
            data = global_batches(8, 2 * world_size)
            torch.testing.assert_close(_train(engine, data), _train(plain, data), rtol=1e-6, atol=0)
            assert engine.partitioned is not None
            away = [u for u in engine.partitioned.units if not u.persistent]
            assert all(u.shard.untyped_storage().nbytes() == 0 for u in away)
            del reference
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @pytest.mark.parametrize("world_size", [2])
    def test_aio_section_sets_the_nvme_requests(self, world_size: int) -> None:
        """A ZeRO-Infinity config as DeepSpeed users write it, ``aio`` included (small blocks,
        so the states here span many requests): the requests follow it, the losses do not
        change, and offload_states uses the same requests."""
        folder = _folder()
        try:
            offload = {"device": "nvme", "nvme_path": str(folder), "pin_memory": True}
            aio = {"block_size": 6000, "queue_depth": 3, "thread_count": 2, "single_submit": False}
            engine, reference = _engine(3, {"offload_optimizer": offload}, aio=aio)
            io = engine.optimizer.swapper.offloader.io
            assert (io.threads, io.chunk_bytes) == (6, 8192)  # 3 x 2 in flight, 4 KiB-aligned
            assert engine._offloaded.offloader is engine.optimizer.swapper.offloader
            data = global_batches(4, 2 * world_size)
            torch.testing.assert_close(
                _train(engine, data), plain_losses(reference, data, lr=LR), rtol=1e-5, atol=0
            )
            engine.destroy()
        finally:
            shutil.rmtree(folder, ignore_errors=True)


class TestOffloadParam(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_host_shards_match_plain_pytorch(self, world_size: int) -> None:
        zero = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
        engine, reference = _engine(3, zero)
        assert engine.partitioned is not None
        assert all(u.shard.device.type == "cpu" for u in engine.partitioned.units)
        data = global_batches(6, 2 * world_size)
        torch.testing.assert_close(
            _train(engine, data), plain_losses(reference, data, lr=LR), rtol=1e-5, atol=0
        )

    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("optimizer", ["none", "nvme"])
    def test_nvme_shards_match_plain_pytorch(self, world_size: int, optimizer: str) -> None:
        folder = _folder()
        try:
            zero = {
                "offload_param": {"device": "nvme", "nvme_path": str(folder)},
                "offload_optimizer": {"device": optimizer, "nvme_path": str(folder)},
            }
            engine, reference = _engine(3, zero)
            data = global_batches(5, 2 * world_size)
            torch.testing.assert_close(
                _train(engine, data), plain_losses(reference, data, lr=LR), rtol=1e-5, atol=0
            )
            # between steps only the persistent unit's shard is in memory; the rest is in files
            assert engine.partitioned is not None
            away = [u for u in engine.partitioned.units if not u.persistent]
            assert away
            assert all(u.shard.untyped_storage().nbytes() == 0 for u in away)
            # one checked zoffload file per shard, each holding exactly that shard's bytes
            files = [zoffload.check_file(f) for f in folder.glob("zengine-params-*/*.swap")]
            assert sorted(e.nbytes for f in files for e in f.storages) == sorted(
                u.shard.numel() * u.shard.element_size() for u in away
            )
            # the full values are still there: gathered from the files on demand
            for name, param in engine.module.named_parameters():
                full = zengine.safe_get_full_fp32_param(param)
                assert full is not None, name
                assert torch.isfinite(full).all(), name
            engine.destroy()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("precision", ["bf16", "fp16"])
    def test_zero_infinity_in_half_precision(self, world_size: int, precision: str) -> None:
        """Shards in bf16/fp16 on NVMe, fp32 masters and Adam state on NVMe: the same losses
        as the run that keeps everything in memory (the bytes come back exactly)."""
        folder = _folder()
        try:
            offload = {"device": "nvme", "nvme_path": str(folder)}
            half = {precision: {"enabled": True, "initial_scale_power": 8}}
            if precision == "bf16":
                half = {"bf16": {"enabled": True}}
            zero = {"offload_param": offload, "offload_optimizer": offload}
            engine, _ = _engine(3, zero, **half)
            plain, _ = _engine(3, {}, **half)
            data = global_batches(5, 2 * world_size)
            torch.testing.assert_close(_train(engine, data), _train(plain, data), rtol=0, atol=0)
            assert engine.partitioned is not None
            shards = [u.shard for u in engine.partitioned.units if not u.persistent]
            assert shards
            assert all(s.dtype != torch.float32 for s in shards)
            assert all(s.untyped_storage().nbytes() == 0 for s in shards)
            engine.destroy()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @pytest.mark.parametrize("world_size", [1])
    def test_bad_offload_settings_are_named(self, world_size: int) -> None:
        torch.manual_seed(0)
        with pytest.raises(ValueError, match=r"offload_optimizer: needs ZeRO stage 1, 2 or 3"):
            zengine.initialize(
                model=TinyGPT(), config=_config(0, {"offload_optimizer": {"device": "cpu"}})
            )


def _tile_size(world_size: int, tiles: int = 4) -> int:
    """A sub_group_size that cuts TinyGPT's shards into about `tiles` tiles per rank."""
    return sum(p.numel() for p in TinyGPT().parameters()) // world_size // tiles


class TestTiledStep(DistributedTest):
    """[Note: tiled steps]: the step goes a few units at a time (``sub_group_size``)."""

    @pytest.mark.parametrize("world_size", [1, 2])
    @pytest.mark.parametrize("offload", ["none", "nvme"])
    def test_tiles_change_nothing_but_memory(self, world_size: int, offload: str) -> None:
        folder = _folder()
        try:
            zero: dict[str, Any] = {}
            if offload == "nvme":
                nvme = {"device": "nvme", "nvme_path": str(folder)}
                zero = {"offload_optimizer": nvme, "offload_param": nvme}
            extra = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5}
            tiled, _ = _engine(3, {**zero, "sub_group_size": _tile_size(world_size)}, **extra)
            whole, _ = _engine(3, zero, **extra)
            assert len(tiled.optimizer.tile_tensors()) >= 3
            assert len(whole.optimizer.tile_tensors()) == 1
            data = global_batches(6, 2 * world_size)
            torch.testing.assert_close(_train(tiled, data), _train(whole, data), rtol=0, atol=0)
            if offload == "nvme":  # between steps every released shard is in its file again
                assert tiled.partitioned is not None
                away = [u for u in tiled.partitioned.units if not u.persistent]
                assert all(u.shard.untyped_storage().nbytes() == 0 for u in away)
            for a, b in zip(tiled.parameters(), whole.parameters(), strict=True):
                full_a = zengine.safe_get_full_fp32_param(a)
                full_b = zengine.safe_get_full_fp32_param(b)
                assert full_a is not None
                assert full_b is not None
                assert torch.equal(full_a, full_b)
            tiled.destroy()
            whole.destroy()
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @pytest.mark.parametrize("world_size", [1, 2])
    def test_only_a_few_tiles_are_in_memory_during_the_step(self, world_size: int) -> None:
        folder = _folder()
        try:
            nvme = {"device": "nvme", "nvme_path": str(folder)}
            zero = {
                "offload_optimizer": nvme,
                "sub_group_size": _tile_size(world_size, 6),
                "module_group_size": 0,  # a unit per module: tiles hold few of TinyGPT's
            }
            engine, _ = _engine(3, zero)
            optimizer = engine.optimizer
            tiles = optimizer.tile_tensors()
            largest = max(sum(t.numel() for t in tile) for tile in tiles)
            every = [t for tile in tiles for t in tile]
            step = optimizer.optimizer.step
            resident: list[int] = []

            def watched(*args: Any, **kwargs: Any) -> Any:
                # the masters in memory while torch's step runs (their state goes with them)
                resident.append(sum(t.numel() for t in every if t.untyped_storage().nbytes()))
                return step(*args, **kwargs)

            optimizer.optimizer.step = watched  # type: ignore[method-assign]
            _train(engine, global_batches(3, 2 * world_size))
            assert len(resident) == 3 * len(tiles)  # one torch step per tile
            total = sum(t.numel() for t in every)
            # the tile stepped, the next read ahead, the last being written: never them all
            assert max(resident) <= 3 * largest < total
            engine.destroy()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
