"""The secondary partition (ZeRO++'s hpZ): parity with plain PyTorch, the backward's gathers kept
inside a node (bytes per link class), the secondary shards' lifetime, narrow gathers, bad sizes.
World 4 runs as 2 nodes of 2 ranks, world 2 as one node of 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zcomm
import zpartition
from zcomm.testing import DistributedTest
from zpartition import ZeroParamConfig, ZeroParamError

from ._helpers import (
    HEADER,
    REGATHERED,
    TinyGPT,
    batches,
    groups,
    link_bytes,
    nodes_of,
    pass_bytes,
    reference_losses,
    train_partitioned,
)


def _config(secondary: int, prefetch: int = 1600) -> ZeroParamConfig:
    # the backward gathers every unit again (prefetched too, with the default bucket)
    return ZeroParamConfig(
        **{**REGATHERED, "prefetch_bucket_size": prefetch}, secondary_partition_size=secondary
    )


def _seeded(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with zpartition.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


class TestParity(DistributedTest):
    # without and with hpZ on 2 nodes, accumulation 1 and 4, and one node (the suite's time
    # is budgeted)
    @pytest.mark.parametrize(
        ("world_size", "secondary", "accumulation"), [(4, 1, 1), (4, 2, 1), (4, 2, 4), (2, 2, 4)]
    )
    def test_training_matches_plain_pytorch(
        self, world_size: int, secondary: int, accumulation: int
    ) -> None:
        with nodes_of(2):
            model, reference = _seeded(), _seeded()
            handle = zpartition.partition(model, config=_config(secondary))
            assert (handle.secondary_group is None) == (secondary == 1)
            data = batches(3, 4 * world_size)
            losses = train_partitioned(
                model, handle.shard_parameters(), data, 0.1, accumulation=accumulation
            )
            expected = reference_losses(reference, data, 0.1)
            torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
            for n, value in _full(model).items():
                torch.testing.assert_close(value, reference.get_parameter(n), rtol=1e-5, atol=1e-6)
            assert all(u.secondary_bytes == 0 for u in handle.units)


class TestHybrid(DistributedTest):
    world_size = 4

    @pytest.mark.parametrize(("node", "pairs"), [(2, [[0, 1], [2, 3]]), (4, [[0, 2], [1, 3]])])
    def test_it_composes_with_hybrid_sharding(self, node: int, pairs: list[list[int]]) -> None:
        # secondary groups within the shard groups: consecutive ones on 2 nodes of 2, and shard
        # groups of ranks 2 apart on one node of 4 (the groups exchanged across the world)
        rank = zcomm.get_rank()
        shard_groups = groups(pairs)
        others = [[p[0] for p in pairs], [p[1] for p in pairs]]
        replicate_groups = groups(others)
        group = next(g for g, p in zip(shard_groups, pairs, strict=True) if rank in p)
        replicate = next(g for g, p in zip(replicate_groups, others, strict=True) if rank in p)
        with nodes_of(node):
            model, reference = _seeded(rank), _seeded()
            handle = zpartition.partition(
                model, config=_config(2), group=group, replicate_group=replicate
            )
            secondary = handle.secondary_group
            assert secondary is not None
            mine = next(p for p in pairs if rank in p)
            assert dist.get_process_group_ranks(secondary) == mine  # the whole shard group
            data = batches(2, 16)
            losses = train_partitioned(
                model, handle.shard_parameters(), data, 0.1, accumulation=4, handle=handle
            )
            expected = reference_losses(reference, data, 0.1)
            torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)


def _unit_bytes(handle: zpartition.Partitioned) -> tuple[int, int, int]:
    """Bytes of one rank's shards of the released units and of the persistent one, and how
    many released units there are."""
    released = [u for u in handle.units if not u.persistent]
    persistent = sum(int(u.shard.numel()) for u in handle.units if u.persistent)
    return sum(int(u.shard.numel()) for u in released), persistent, len(released)


class TestTraffic(DistributedTest):
    world_size = 4

    def test_the_backward_gathers_within_nodes(self) -> None:
        # 2 nodes of 2: every collective of the world crosses nodes. No prefetch: one gather
        # (and one header) per unit fetched; one gradient bucket: one reduce-scatter.
        world, rank = 4, zcomm.get_rank()
        measured: dict[int, list[dict[str, tuple[int, int]]]] = {}
        with nodes_of(2):
            for secondary in (1, 2):
                model = _seeded()
                handle = zpartition.partition(model, config=_config(secondary, prefetch=0))
                opt = torch.optim.SGD(handle.shard_parameters(), lr=0.1)
                for tokens in batches(2, 4 * world):  # the second step is measured
                    passes = pass_bytes(model, tokens.chunk(world)[rank])
                    opt.step()
                    opt.zero_grad()
                measured[secondary] = passes
            released, persistent, units = _unit_bytes(handle)
        header, local = HEADER * world, HEADER * 2  # an agreement across the world, a node
        # the forward gathers every unit and the persistent one (stepped), a header each
        forward = {
            "all_gather_into_tensor": (0, world * (released + persistent) + (units + 1) * header)
        }
        reduced = world * (released + persistent)  # every gradient, reduce-scattered
        assert measured[1][0] == measured[2][0] == forward
        # plain: the backward gathers every unit across nodes, then one header for the
        # reduce-scatter and one at the end of backward
        assert measured[1][1] == {
            "all_gather_into_tensor": (0, world * released + (units + 2) * header),
            "reduce_scatter_tensor": (0, reduced),
        }
        # hpZ: the same rows gathered within each node, headers too; across nodes only the
        # gradients and their two headers
        assert measured[2][1] == {
            "all_gather_into_tensor": (world * released + units * local, 2 * header),
            "reduce_scatter_tensor": (0, reduced),
        }
        # per step across nodes: plain ZeRO-3's less the backward's gathers and their headers
        across = {s: sum(b[1] for p in measured[s] for b in p.values()) for s in (1, 2)}
        assert across[2] == across[1] - world * released - units * header


class TestSecondaryShards(DistributedTest):
    world_size = 4

    def test_held_from_the_forward_to_the_backward_gather(self) -> None:
        world, rank = 4, zcomm.get_rank()
        with nodes_of(2):
            model = _seeded()
            # frozen, block 0 gets no gradient and its backward fetches nothing: the end of
            # the backward drops its secondary shards
            for p in [model.embed.weight, *model.blocks[0].parameters()]:
                p.requires_grad_(False)
            handle = zpartition.partition(model, config=_config(2, prefetch=0))
            released = [u for u in handle.units if not u.persistent]
            persistent = [u for u in handle.units if u.persistent]
            tokens = batches(1, 4 * world)[0].chunk(world)[rank]
            with torch.no_grad():
                model(tokens)  # no backward follows: nothing kept
            assert [u.secondary_bytes for u in handle.units] == [0] * len(handle.units)
            loss = model(tokens)
            # 1/2 of each released unit: the rows of 2 of the 4 ranks
            assert [u.secondary_bytes for u in released] == [
                2 * int(u.shard.numel()) for u in released
            ]
            assert [u.secondary_bytes for u in persistent] == [0]
            # when block 1's up weight has its gradient, the units whose backward fetched them
            # (the head's embedding, blocks 2 and 1) hold none; block 0's still do
            seen: list[list[int]] = []
            weight = model.get_parameter("blocks.1.up.weight")
            weight.register_post_accumulate_grad_hook(
                lambda _: seen.append([u.secondary_bytes for u in released])
            )
            loss.backward()
            names = [u.name for u in released]
            held = {n for n, nbytes in zip(names, seen[0], strict=True) if nbytes}
            assert held == {"blocks.0.up", "blocks.0.down"}
            assert [u.secondary_bytes for u in handle.units] == [0] * len(handle.units)

    def test_shards_written_after_the_forward_are_gathered_from_primaries(self) -> None:
        world, rank = 4, zcomm.get_rank()
        with nodes_of(2):
            model = _seeded()
            handle = zpartition.partition(model, config=_config(2, prefetch=0))
            unit = next(u for u in handle.units if u.name == "blocks.1.up")
            tokens = batches(1, 4 * world)[0].chunk(world)[rank]
            loss = model(tokens)
            assert unit.secondary_bytes > 0
            with torch.no_grad():
                model.get_parameter("blocks.1.up.weight").ds_tensor.mul_(1.0)  # version moves
            gathered = link_bytes(lambda: loss.backward())["all_gather_into_tensor"]
            header = HEADER * world
            # across nodes: that unit's rows and header, the reduce-scatter's, the end's
            assert gathered[1] == world * int(unit.shard.numel()) + 3 * header


class TestNarrowGathers(DistributedTest):
    world_size = 4

    def test_the_backward_widens_what_the_forward_gathered(self) -> None:
        # Linear weights gathered in bf16 for the passes: with hpZ the backward reads the
        # forward's narrowed rows, bit for bit what plain ZeRO-3 computes
        world, rank = 4, zcomm.get_rank()
        results = []
        with nodes_of(2):
            for secondary in (1, 2):
                model = _seeded()
                for m in model.modules():
                    if isinstance(m, nn.Linear):
                        m.weight.comm_dtype = torch.bfloat16
                handle = zpartition.partition(model, config=_config(secondary))
                wide = next(u for u in handle.units if u.name == "blocks.0.up")
                if secondary == 2:
                    model(batches(1, 4 * world)[0].chunk(world)[rank])
                    assert wide.wire_bytes is not None
                    assert wide.secondary_bytes == 2 * wide.wire_bytes  # half the fp32 rows
                    handle.release_all()
                    assert wide.secondary_bytes == 0
                data = batches(3, 4 * world)
                losses = train_partitioned(
                    model, handle.shard_parameters(), data, 0.1, accumulation=2
                )
                results.append((losses, _full(model)))
        (plain, plain_values), (hpz, hpz_values) = results
        assert plain == hpz
        for n, value in plain_values.items():
            torch.testing.assert_close(hpz_values[n], value, rtol=0, atol=0, msg=n)


class TestBadSizes(DistributedTest):
    world_size = 4

    def test_sizes_that_do_not_fit_are_named(self) -> None:
        with pytest.raises(ValueError, match="secondary_partition_size must be >= 1"):
            ZeroParamConfig(secondary_partition_size=0)
        with pytest.raises(TypeError, match="integer number of ranks"):
            ZeroParamConfig(secondary_partition_size=1.5)  # type: ignore[arg-type]
        rank = zcomm.get_rank()
        pairs = groups([[0, 1], [2, 3]])
        crossed = groups([[0, 2], [1, 3]])
        cases = [
            (2, None, 4, "secondary_partition_size 4 is larger than a node and does not divide"),
            (4, None, 3, "secondary_partition_size 3 does not divide a node's 4 ranks"),
            (4, pairs[rank // 2], 4, "does not divide the 2 ranks partitioned across"),
            (2, crossed[rank % 2], 2, r"the secondary group of ranks \[\d, \d\] .*spans nodes"),
        ]
        for node, group, size, message in cases:
            with nodes_of(node):
                model = TinyGPT()
                config = ZeroParamConfig(secondary_partition_size=size)
                with pytest.raises(ZeroParamError, match=message):
                    zpartition.partition(model, config=config, group=group)
                assert not any(hasattr(p, "ds_id") for p in model.parameters())  # left as it was
        with nodes_of(2):
            with pytest.raises(ZeroParamError, match="larger than a node"):
                zpartition.Init(config=ZeroParamConfig(secondary_partition_size=4))
            with zpartition.Init(config=ZeroParamConfig(secondary_partition_size=2)):
                model = TinyGPT()
            handle = zpartition.partition(model, config=_config(2))
            assert handle.secondary_group is not None
            first = rank // 2 * 2  # consecutive ranks on this rank's node
            assert dist.get_process_group_ranks(handle.secondary_group) == [first, first + 1]
