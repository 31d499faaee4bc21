"""DeepSpeed's attribute names on the ZeRO optimizer: views of its state, with DeepSpeed's
meanings and shapes, checked against the values computed by hand."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest

from ._helpers import SCALE_SIZES as SIZES
from ._helpers import Scale as _Scale


def _engine(stage: int, **extra: Any) -> tuple[zengine.Engine, Any, list[nn.Parameter]]:
    """Two optimizer groups: the first two parameters, and the third."""
    model = _Scale()
    params = list(model.params)
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }
    engine, optimizer, *_ = zengine.initialize(model=model, model_parameters=groups, config=cfg)
    return engine, optimizer, params


def _input(rank: int) -> torch.Tensor:
    return (torch.arange(sum(SIZES)) % 5 + 1 + rank).float()


def _mean_grads(world: int) -> list[torch.Tensor]:
    """Each parameter's reduced (mean) gradient, by hand."""
    mean = sum(_input(r) for r in range(world)) / world
    return list(mean.split(list(SIZES)))


class TestGradientPartitions(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_stage3_shards_padded_on_the_last_ranks(self, world_size: int) -> None:
        engine, optimizer, params = _engine(3)
        rank = zcomm.get_rank()
        engine.backward(engine(_input(rank)))
        found = optimizer.get_fp32_grad_partitions()
        assert sorted(found) == [0, 1]
        assert sorted(found[0]) == [0, 1]
        assert sorted(found[1]) == [0]
        where = {0: (0, 0), 1: (0, 1), 2: (1, 0)}  # parameter -> (group, index in it)
        for k, grad in enumerate(_mean_grads(world_size)):
            chunk = -(-grad.numel() // world_size)
            padded = torch.cat([grad, torch.zeros(chunk * world_size - grad.numel())])
            g, i = where[k]
            mine = found[g][i]
            assert mine.dtype == torch.float32
            assert mine.shape == (chunk,)
            torch.testing.assert_close(mine, padded[rank * chunk : (rank + 1) * chunk])
            # a view of the gradient partition (fp32), not a copy
            grad_of = optimizer.partitions.grad_of(params[k])
            assert mine.data_ptr() == grad_of.data_ptr()
        engine.destroy()

    @pytest.mark.parametrize("world_size", [2])
    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_groups_and_norms(self, world_size: int, stage: int) -> None:
        engine, optimizer, params = _engine(stage)
        assert [[id(p) for p in g] for g in optimizer.fp16_groups] == [
            [id(params[0]), id(params[1])],
            [id(params[2])],
        ]
        engine.backward(engine(_input(zcomm.get_rank())))
        grads = _mean_grads(world_size)
        expected = [torch.cat(grads[:2]).norm(), grads[2].norm()]
        norms = optimizer._get_norm_groups()
        torch.testing.assert_close(torch.stack(norms), torch.stack(expected))
        engine.step()
        assert optimizer._global_grad_norm == engine.get_global_grad_norm()
        assert optimizer._global_grad_norm == pytest.approx(float(torch.stack(expected).norm()))
        engine.destroy()


class TestPartitionAlignment(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize("stage", [1, 2])
    def test_partitions_start_on_4_bytes(self, world_size: int, stage: int) -> None:
        engine, optimizer, params = _engine(stage, bf16={"enabled": True})
        factor = optimizer.nccl_start_alignment_factor
        assert factor == 2
        rank = zcomm.get_rank()
        engine.backward(engine(_input(rank).bfloat16()))
        engine.step()
        groups = [params[:2], params[2:]]
        for g, partitions in enumerate(optimizer.parallel_partitioned_bit16_groups):
            assert len(partitions) == world_size
            size = partitions[0].numel()
            assert size % factor == 0
            assert all(p.numel() == size for p in partitions)
            for part in partitions:
                assert part.dtype == torch.bfloat16
                assert part.data_ptr() % (2 * factor) == 0  # DeepSpeed's own check
            # views of the storage the parameters are views of: they show the stepped values
            whole = torch.cat(partitions)
            values = torch.cat([p.detach().reshape(-1) for p in groups[g]])
            assert torch.equal(whole[: values.numel()], values)
            assert torch.all(whole[values.numel() :] == 0)  # the padding
            master = optimizer.single_partition_of_fp32_groups[g]
            assert torch.equal(partitions[rank], master.bfloat16())
        assert optimizer.parallel_partitioned_fp16_groups is not None  # the older name
        engine.destroy()

    @pytest.mark.parametrize("world_size", [2])
    @pytest.mark.parametrize("stage", [0, 3])
    def test_other_stages_have_no_such_attribute(self, world_size: int, stage: int) -> None:
        engine, optimizer, _ = _engine(stage)
        for name in ("nccl_start_alignment_factor", "parallel_partitioned_bit16_groups"):
            with pytest.raises(AttributeError, match=f"this optimizer runs ZeRO stage {stage}"):
                getattr(optimizer, name)
            assert not hasattr(optimizer, name)
        engine.destroy()


class TestStage3SubGroups(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_sub_groups_and_their_flat_masters(self, world_size: int) -> None:
        """With a small ``sub_group_size`` each Linear is a sub-group of its own (tiles end
        between modules), listed as DeepSpeed lists them; each has one flat fp32 master, the
        tensor the torch optimizer keeps its state for (DeepSpeed's TestZeroAdamOptimizerStepCount
        reads the step count there)."""
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "sub_group_size": 4,
            },
        }
        engine, optimizer, *_ = zengine.initialize(model=model, config=cfg)
        layers = [cast(nn.Linear, layer) for layer in model]
        expected = [[id(layer.weight), id(layer.bias)] for layer in layers]
        assert [[id(p) for p in g] for g in optimizer.fp16_groups] == expected
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum())
            engine.step()
        flats = optimizer.fp32_partitioned_groups_flat
        assert len(flats) == len(layers)
        for flat, layer in zip(flats, layers, strict=True):
            shards = [layer.weight.ds_tensor, layer.bias.ds_tensor]
            assert flat.dtype == torch.float32
            assert flat.numel() == sum(s.numel() for s in shards)
            assert int(optimizer.optimizer.state[flat]["step"]) == engine.global_steps == 2
            # the masters are the flat's pieces, the shards their bf16 copies
            assert torch.equal(torch.cat(shards).float(), flat.bfloat16().float())
        engine.destroy()

    @pytest.mark.parametrize("world_size", [2])
    def test_fp32_shards_have_no_flat_copy(self, world_size: int) -> None:
        engine, optimizer, params = _engine(3)
        assert [[id(p) for p in g] for g in optimizer.fp16_groups] == [
            [id(params[0]), id(params[1])],
            [id(params[2])],
        ]
        with pytest.raises(AttributeError, match="fp32 shards are their own masters"):
            optimizer.fp32_partitioned_groups_flat  # noqa: B018
        engine.destroy()
