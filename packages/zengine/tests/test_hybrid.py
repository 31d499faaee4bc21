"""Hybrid sharding (``zero_optimization.mics_shard_size``; DeepSpeed's MiCS, FSDP2's HSDP):
ZeRO-3 within shard groups, replicas across them, gradients across them once per step."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest

from ._helpers import (
    LR,
    TinyGPT,
    checkpoint_engine,
    engine_config,
    global_batches,
    plain_losses,
    train_engine,
    train_global,
)


def _config(shard_size: int | str, accumulation: int = 1, **zero: Any) -> dict[str, Any]:
    cfg = engine_config(3, accumulation=accumulation, gradient_clipping=0.5)  # clipping on
    cfg["zero_optimization"] |= {"mics_shard_size": shard_size, **zero}
    return cfg


def _engine(cfg: dict[str, Any]) -> tuple[zengine.Engine, TinyGPT, TinyGPT]:
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    engine, *_ = zengine.initialize(model=model, config=cfg)
    return engine, model, reference


class TestHybridSharding(DistributedTest):
    world_size = 4

    # each shard size once, each accumulation twice (the suite's time is budgeted)
    @pytest.mark.parametrize(("shard_size", "accumulation"), [(2, 1), ("node", 4), (1, 4), (4, 1)])
    def test_losses_are_plain_pytorchs(self, shard_size: int | str, accumulation: int) -> None:
        # 4 ranks as 2 nodes x 2: shard groups of 2 (a node), of 1 (replicas only), of 4
        zcomm.set_node_layout(2)
        engine, model, reference = _engine(_config(shard_size, accumulation))
        size = 2 if shard_size == "node" else int(shard_size)
        # each rank holds 1 / shard size of every parameter (its padded chunk)
        for p in model.parameters():
            assert p.ds_tensor.numel() == math.ceil(p.ds_numel / size)
        data = global_batches(4, 2 * accumulation * 4)
        expected = plain_losses(reference, data, lr=LR, clip=0.5)
        torch.testing.assert_close(train_engine(engine, data), expected, rtol=1e-5, atol=0)

    def test_gradients_cross_nodes_once_per_step(self) -> None:
        zcomm.set_node_layout(2)
        accumulation = 4
        engine, _, _ = _engine(_config("node", accumulation))
        grads = engine.optimizer.partitions.grad_partitions_flat_buffer
        data = global_batches(2, 2 * accumulation * 4)
        zcomm.enable_comm_accounting()
        try:
            for tokens in data:
                zcomm.reset_comm_accounting()
                pieces = tokens.view(accumulation, 4, -1, tokens.shape[-1])
                for k in range(accumulation):
                    engine.backward(engine(pieces[k, zcomm.get_rank()]))
                    engine.step()
                crossed = zcomm.comm_bytes_by_link()
                # the gradient partition's one all-reduce across the replicas; nothing else
                assert crossed["inter_node"] == grads.numel() * grads.element_size()
                assert crossed["intra_node"] > 0
        finally:
            zcomm.enable_comm_accounting(False)
            zcomm.reset_comm_accounting()

    def test_hpz_keeps_the_backward_gathers_in_the_node(self) -> None:
        # zero_hpz_partition_size 2 on 2 nodes x 2: plain ZeRO-3's losses, and fewer bytes
        # across nodes (the backward's gathers of released units stay in the node)
        zcomm.set_node_layout(2)
        crossed = {}
        for hpz in (1, 2):
            cfg = _config(-1, stage3_max_reuse_distance=0, zero_hpz_partition_size=hpz)
            engine, _, reference = _engine(cfg)
            data = global_batches(2, 2 * 4)
            zcomm.enable_comm_accounting()
            zcomm.reset_comm_accounting()
            try:
                losses = train_engine(engine, data)
                crossed[hpz] = zcomm.comm_bytes_by_link()["inter_node"]
            finally:
                zcomm.enable_comm_accounting(False)
            expected = plain_losses(reference, data, lr=LR, clip=0.5)
            torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
        assert 0 < crossed[2] < crossed[1]
        for bad, problem in ((4, "must divide a node's 2 ranks"), (3, "must divide a node's")):
            with pytest.raises(ValueError, match=f"zero_hpz_partition_size: {bad} {problem}"):
                _engine(_config(-1, zero_hpz_partition_size=bad))

    def test_the_progress_breakdown_reports_bytes_per_link_class(self) -> None:
        zcomm.set_node_layout(2)
        cfg = _config("node") | {"wall_clock_breakdown": True, "steps_per_print": 1}
        engine, _, _ = _engine(cfg)
        grads = engine.optimizer.partitions.grad_partitions_flat_buffer
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("zengine").addHandler(handler)
        try:
            tokens = global_batches(1, 2 * 4)[0].view(4, 2, -1)[zcomm.get_rank()]
            engine.backward(engine(tokens))
            engine.step()
        finally:
            logging.getLogger("zengine").removeHandler(handler)
            zcomm.enable_comm_accounting(False)
        if zcomm.get_rank() == 0:
            (line,) = [line for line in lines if line.startswith("bytes per step:")]
            intra, inter = (float(part.split()[1]) for part in line.split(": ")[1].split(" | "))
            assert line.split(": ")[1].startswith("intra_node ")
            assert inter == round(grads.numel() * grads.element_size() / 2**20, 2)
            assert intra > 0  # the gathers and reduce-scatters, within the node

    @pytest.mark.parametrize(
        ("shard_size", "problem"),
        [
            (3, "shard size 3: must divide the world of 4 ranks"),
            (0, 'must be -1 \\(off\\), a number of ranks, or "node"'),
        ],
    )
    def test_a_bad_shard_size_is_named(self, shard_size: int, problem: str) -> None:
        with pytest.raises(ValueError, match=f"mics_shard_size.*{problem}"):
            _engine(_config(shard_size))

    def test_hierarchical_gather_only_within_a_node(self) -> None:
        zcomm.set_node_layout(2)
        with pytest.raises(ValueError, match=r"mics_hierarchical_params_gather.*span nodes"):
            _engine(_config(4, mics_hierarchical_params_gather=True))
        engine, _, _ = _engine(_config(2, mics_hierarchical_params_gather=True))
        assert engine.optimizer.partitions.grad_partitions_flat_buffer.numel() > 0


class TestNodeLocalAccumulation(DistributedTest):
    world_size = 4

    def test_losses_are_plain_pytorchs_and_gradients_cross_nodes_once_per_step(self) -> None:
        zcomm.set_node_layout(2)  # 2 nodes x 2, plain ZeRO-3 across all 4 ranks
        accumulation, steps = 4, 3
        engine, _, reference = _engine(_config(-1, accumulation, node_local_accumulation=True))
        data = global_batches(steps, 2 * accumulation * 4)
        zcomm.enable_comm_accounting()
        zcomm.reset_comm_accounting()
        try:
            losses = train_engine(engine, data)
            scattered = zcomm.comm_summary()["reduce_scatter_tensor"]
        finally:
            zcomm.enable_comm_accounting(False)
        expected = plain_losses(reference, data, lr=LR, clip=0.5)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
        # per step, one reduce-scatter across the nodes of 2 (nodes) x every trainable shard
        # gradient and a presence flag per gradient group, fp32; every micro-batch's stays in
        # the node
        assert engine.partitioned is not None
        shards = sum(p.ds_tensor.numel() for p in engine.parameters() if p.requires_grad)
        flags = sum(len(u.grad_groups) for u in engine.partitioned.units)
        assert scattered.inter_node_bytes == steps * 4 * 2 * (shards + flags)
        assert scattered.intra_node_bytes == steps * accumulation * 4 * 4 * shards
        with pytest.raises(
            ValueError, match=r"node_local_accumulation: not with .*mics_shard_size"
        ):
            _engine(_config("node", node_local_accumulation=True))


class TestHybridStages(DistributedTest):
    world_size = 2

    def test_hpz_is_stage_3s(self) -> None:
        cfg = engine_config(2)
        cfg["zero_optimization"]["zero_hpz_partition_size"] = 2
        with pytest.raises(
            ValueError, match="zero_hpz_partition_size: ZeRO\\+\\+'s hpZ is stage 3"
        ):
            zengine.initialize(model=TinyGPT(), config=cfg)

    def test_node_local_accumulation_is_stage_3s(self) -> None:
        cfg = engine_config(2)
        cfg["zero_optimization"]["node_local_accumulation"] = True
        with pytest.raises(ValueError, match="node_local_accumulation: it is ZeRO stage 3's"):
            zengine.initialize(model=TinyGPT(), config=cfg)

    def test_hybrid_sharding_is_stage_3s(self) -> None:
        cfg = engine_config(2)
        cfg["zero_optimization"]["mics_shard_size"] = 1
        with pytest.raises(ValueError, match="mics_shard_size: hybrid sharding is ZeRO stage 3"):
            zengine.initialize(model=TinyGPT(), config=cfg)


class TestHybridCheckpoints(DistributedTest):
    world_size = 4

    @pytest.mark.parametrize("frozen", [False, True])
    def test_saved_at_one_shard_size_loads_at_any(self, tmp_path: Path, frozen: bool) -> None:
        # saved on 2 x 2 (frozen: the embedding has no master, its shards are saved); loaded
        # on 1 x 4 (plain ZeRO-3), 4 x 1 (replicas only) and 2 x 2: training goes on alike
        data = global_batches(4, 2 * 4)
        saver = checkpoint_engine(3, frozen=frozen, zero_optimization=_zero(2))
        train_global(saver, data[:2])
        saver.save_checkpoint(tmp_path, tag="t")
        expected = train_global(saver, data[2:])
        for shard_size in (-1, 1, 2):
            loader = checkpoint_engine(
                3, seed=1, frozen=frozen, zero_optimization=_zero(shard_size)
            )
            loader.load_checkpoint(tmp_path, tag="t")
            torch.testing.assert_close(train_global(loader, data[2:]), expected, rtol=1e-5, atol=0)


def _zero(shard_size: int) -> dict[str, Any]:
    return {"stage": 3, "stage3_param_persistence_threshold": 16, "mics_shard_size": shard_size}
