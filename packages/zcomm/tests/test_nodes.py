"""Nodes: the layout (set, from the launcher, one node by default), the intra- and inter-node
groups, and the accounting of bytes by link class; 4 processes pretend to be 2 x 2, 1 x 4
and 4 x 1."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zcomm
from zcomm._nodes import layout_from_launcher
from zcomm.testing import DistributedTest

# Elements all-reduced on the world, the intra-node and the inter-node group: three sizes,
# so that each group's bytes are told apart in the totals.
_WORLD, _INTRA, _INTER = 16, 8, 4


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


class TestNodes(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2, 4])
    def test_one_node_by_default(self, world_size: int) -> None:
        # the harness sets LOCAL_WORLD_SIZE to the world size, as torchrun on one machine
        layout = zcomm.node_layout()
        assert layout == zcomm.NodeLayout(ranks_per_node=world_size, nodes=1)
        assert zcomm.node_layout() is layout  # worked out once
        rank = zcomm.get_rank()
        assert zcomm.intra_node_group() is dist.group.WORLD  # no second world communicator
        assert _ranks(zcomm.inter_node_group()) == [rank]

    @pytest.mark.world_size(4)
    def test_layouts_groups_and_bytes_by_link(self) -> None:
        rank = zcomm.get_rank()
        zcomm.enable_comm_accounting()
        world_bytes, intra_bytes, inter_bytes = 4 * _WORLD, 4 * _INTRA, 4 * _INTER
        # ranks_per_node -> (expected intra-node bytes, inter-node bytes) of the three calls;
        # a group of one sends nothing, so it counts nothing
        expected = {
            2: (intra_bytes, world_bytes + inter_bytes),
            4: (world_bytes + intra_bytes, 0),
            1: (0, world_bytes + inter_bytes),
        }
        for k, (intra, inter) in expected.items():
            layout = zcomm.set_node_layout(k)
            assert zcomm.node_layout() is layout
            assert (layout.ranks_per_node, layout.nodes, layout.world_size) == (k, 4 // k, 4)
            node, local = rank // k, rank % k
            assert (layout.node_of(rank), layout.local_rank_of(rank)) == (node, local)
            assert layout.ranks_of(node) == list(range(node * k, node * k + k))
            assert layout.spans_nodes(range(4)) == (k < 4)
            assert not layout.spans_nodes(layout.ranks_of(node))

            within, across = zcomm.intra_node_group(), zcomm.inter_node_group()
            assert _ranks(within) == layout.ranks_of(node)
            assert _ranks(across) == [n * k + local for n in range(4 // k)]
            assert zcomm.intra_node_group() is within  # built once per layout
            assert zcomm.inter_node_group() is across

            zcomm.reset_comm_accounting()
            for elements, group in ((_WORLD, None), (_INTRA, within), (_INTER, across)):
                t = torch.full((elements,), float(rank))
                zcomm.all_reduce(t, group=group)
                members = range(4) if group is None else _ranks(group)
                assert t[0].item() == sum(members)
            assert zcomm.comm_bytes_by_link() == {"intra_node": intra, "inter_node": inter}
            stats = zcomm.comm_summary()["all_reduce"]
            assert (stats.intra_node_bytes, stats.inter_node_bytes) == (intra, inter)
            assert stats.bytes == intra + inter

        table = zcomm.log_summary(show=False).splitlines()
        assert "| intra-node MB | inter-node MB |" in table[0]
        assert table[2].startswith("| all_reduce | 2 | ")  # 4 x 1: the world's, the inter-node

    @pytest.mark.world_size(4)
    def test_point_to_point_by_its_two_ranks(self) -> None:
        zcomm.set_node_layout(2)
        zcomm.enable_comm_accounting()
        rank = zcomm.get_rank()
        # with the node neighbour (rank ^ 1), then with the same place on the other node
        # (rank ^ 2): 8 bytes each way, once within a node and once across
        for peer in (rank ^ 1, rank ^ 2):
            got = torch.empty(2)
            ops = [
                zcomm.P2POp(zcomm.isend, torch.full((2,), float(rank)), peer),
                zcomm.P2POp(zcomm.irecv, got, peer),
            ]
            for handle in zcomm.batch_isend_irecv(ops):
                handle.wait()
            assert got.tolist() == [float(peer)] * 2
        if rank == 0:  # the blocking calls too (through isend and irecv)
            zcomm.send(torch.ones(4), 3)
        elif rank == 3:
            zcomm.recv(torch.empty(4), 0)
        summary = zcomm.comm_summary()
        extra = 16 if rank in (0, 3) else 0
        for op, mine in (("send", rank == 0), ("recv", rank == 3)):
            assert summary[op].intra_node_bytes == 8
            assert summary[op].inter_node_bytes == 8 + (extra if mine else 0)
        assert zcomm.comm_bytes_by_link() == {"intra_node": 16, "inter_node": 16 + extra}

    @pytest.mark.world_size(4)
    def test_launcher_environment_read_and_checked(self) -> None:
        rank = zcomm.get_rank()
        # torchrun on 2 machines of 2 (the harness restores the environment after the test)
        os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2")
        # before the layout is worked out (a collective) the accounting reads this rank's
        # LOCAL_WORLD_SIZE alone: it never communicates
        zcomm.enable_comm_accounting()
        zcomm.all_reduce(torch.ones(2))
        assert zcomm.comm_bytes_by_link() == {"intra_node": 0, "inter_node": 8}
        assert zcomm.node_layout() == zcomm.NodeLayout(2, 2)
        assert _ranks(zcomm.intra_node_group()) == [rank - rank % 2, rank - rank % 2 + 1]

    @pytest.mark.world_size(4)
    def test_unequal_nodes_fail_on_every_rank(self) -> None:
        rank = zcomm.get_rank()
        node = 0 if rank < 3 else 1  # 3 ranks, then 1
        local, size = (rank, 3) if node == 0 else (0, 1)
        os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(size))
        with pytest.raises(zcomm.TopologyError, match=r"nodes of unequal size: node 0 .*\(3\)"):
            zcomm.node_layout()
        zcomm.barrier()  # every rank raised, and none waits in a collective

    @pytest.mark.world_size(2)
    def test_set_node_layout_must_divide_the_world(self) -> None:
        with pytest.raises(zcomm.TopologyError, match="world of 2 ranks cannot be split into"):
            zcomm.set_node_layout(3)
        with pytest.raises(zcomm.TopologyError, match="nodes of 0"):
            zcomm.set_node_layout(0)
        with pytest.raises(TypeError, match="expected an int"):
            zcomm.set_node_layout("2")  # type: ignore[arg-type]
        assert issubclass(zcomm.TopologyError, ValueError)

    @pytest.mark.world_size(2)
    def test_layout_forgotten_on_destroy(self, tmp_path: Path) -> None:
        zcomm.set_node_layout(1)
        across = zcomm.inter_node_group()
        assert across is dist.group.WORLD
        rank = zcomm.get_rank()
        zcomm.destroy()
        zcomm.init_distributed(init_method=f"file://{tmp_path}/again", rank=rank, world_size=2)
        assert zcomm.node_layout() == zcomm.NodeLayout(2, 1)  # the launcher's again
        assert _ranks(zcomm.inter_node_group()) == [rank]


def test_node_layout_answers() -> None:
    layout = zcomm.NodeLayout(ranks_per_node=4, nodes=3)
    assert [layout.node_of(r) for r in (0, 3, 4, 11)] == [0, 0, 1, 2]
    assert [layout.local_rank_of(r) for r in (0, 3, 4, 11)] == [0, 3, 0, 3]
    assert layout.ranks_of(1) == [4, 5, 6, 7]
    assert layout.spans_nodes([3, 4])
    assert not layout.spans_nodes([8, 11])
    assert not layout.spans_nodes([])
    with pytest.raises(ValueError, match="12 is not a rank"):
        layout.node_of(12)
    with pytest.raises(ValueError, match="3 is not a node"):
        layout.ranks_of(3)
    with pytest.raises(ValueError, match=r"NodeLayout\(nodes=\.\.\.\): expected a positive int"):
        zcomm.NodeLayout(2, 0)


def test_launcher_variables_checked() -> None:
    # (GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE) of each rank, -1 where unset
    assert layout_from_launcher([(-1, -1, -1)] * 3) == zcomm.NodeLayout(3, 1)
    torchrun_2x3 = [(r // 3, r % 3, 3) for r in range(6)]
    assert layout_from_launcher(torchrun_2x3) == zcomm.NodeLayout(3, 2)
    no_group_rank = [(-1, r % 2, 2) for r in range(4)]  # the node from LOCAL_RANK
    assert layout_from_launcher(no_group_rank) == zcomm.NodeLayout(2, 2)

    cases = {
        "nodes of unequal size: node 0 .GROUP_RANK=0. has ranks 0-2 .3., "
        "node 1 .GROUP_RANK=1. has rank 3 .1.": [(0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 1)],
        "node 0 .GROUP_RANK=0. has ranks .0, 2.: a node's ranks must be one contiguous": [
            (0, 0, 2),
            (1, 0, 2),
            (0, 1, 2),
            (1, 1, 2),
        ],
        "LOCAL_WORLD_SIZE is set on rank 0 but not on rank 1": [(0, 0, 2), (0, 1, -1)],
        "rank 1 has LOCAL_WORLD_SIZE=4, but its node": [(0, 0, 2), (0, 1, 4)],
        "rank 1 has LOCAL_RANK=0, but it is rank 1 of its node": [(0, 0, 2), (0, 0, 2)],
    }
    for message, reports in cases.items():
        with pytest.raises(zcomm.TopologyError, match=message):
            layout_from_launcher(reports)
