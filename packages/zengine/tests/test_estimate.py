"""The ZeRO-3 and ZeRO-2 memory estimates: bytes worked out by hand from DeepSpeed's formulas,
the tables."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zcomm
from zengine._estimate import (
    MemoryEstimate,
    estimate_memory,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)


def _mlp() -> nn.Module:
    # Linear(10, 20): 220 params, the largest layer; Linear(20, 5): 105; 325 in all.
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))


def _rows(rows):
    return [
        (r.offload_optimizer, r.offload_param, r.zero_init, r.per_cpu_bytes, r.per_gpu_bytes)
        for r in rows
    ]


def test_small_model_one_gpu():
    rows = estimate_memory(_mlp())
    assert all(isinstance(r, MemoryEstimate) for r in rows)
    # (offload_optimizer, offload_param, zero_init, per CPU, per GPU); largest layer 4 * 220.
    assert _rows(rows) == [
        (True, True, True, 8775, 880),  # cpu 325 * 18 * 1.5
        (True, True, False, 8775, 880),  # cpu 325 * max(4 * 1, 18) * 1.5
        (True, False, True, 7800, 1530),  # cpu 325 * 16 * 1.5; gpu 880 + 2 * 325
        (True, False, False, 7800, 1530),
        (False, False, True, 1320, 6730),  # cpu 220 * 4 * 1.5; gpu 880 + 18 * 325
        (False, False, False, 1950, 6730),  # cpu 325 * 4 * 1.5
    ]


def test_small_model_two_nodes_of_four_gpus():
    rows = estimate_memory(_mlp(), num_gpus_per_node=4, num_nodes=2)
    # 8 GPUs; the CPU figure is per node (x 1/2); without zero_init each of a node's 4 ranks
    # holds the whole model (4 * 4 bytes per param) if that is more.
    assert _rows(rows) == [
        (True, True, True, 4387, 880),  # int(325 * 18 * 0.5 * 1.5) = int(4387.5)
        (True, True, False, 7800, 880),  # 325 * max(16, 9) * 1.5
        (True, False, True, 3900, 961),  # 325 * 16 * 0.5 * 1.5; 880 + int(650 / 8)
        (True, False, False, 7800, 961),  # 325 * max(16, 8) * 1.5
        (False, False, True, 5280, 1611),  # 220 * 4 * 4 * 1.5; 880 + int(5850 / 8)
        (False, False, False, 7800, 1611),  # 325 * 4 * 4 * 1.5
    ]


def test_single_configuration_returns_cpu_gpu_largest_like_deepspeed():
    assert estimate_zero3_model_states_mem_needs(325, 220) == (8775, 880, 880)
    assert estimate_zero3_model_states_mem_needs(
        325, 220, cpu_offload=True, cpu_offload_params=False, zero_init=False
    ) == (7800, 1530, 880)
    assert estimate_zero3_model_states_mem_needs(
        325, 220, num_gpus_per_node=4, num_nodes=2, cpu_offload=False, zero_init=True
    ) == (5280, 1611, 880)
    assert estimate_zero3_model_states_mem_needs(
        325, 220, cpu_offload=False, additional_buffer_factor=1.0
    ) == (880, 6730, 880)


def test_largest_layer_counts_direct_params_only():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.own = nn.Parameter(torch.zeros(30))  # 30 direct params
            self.a = nn.Linear(4, 4)  # 20
            self.b = nn.Linear(4, 4)  # 20: Block holds 70 in all but owns only 30

    rows = estimate_memory(Block())
    assert rows[0].per_gpu_bytes == 4 * 30
    assert rows[0].per_cpu_bytes == int(70 * 18 * 1.5)


def test_tied_weights_count_once():
    emb = nn.Embedding(100, 8)
    head = nn.Linear(8, 100, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    assert estimate_memory(model)[0].per_cpu_bytes == int(800 * 18 * 1.5)


def test_partitioned_params_count_at_full_size():
    # A ZeRO-3 partitioned parameter keeps an empty .data and its full size in ds_numel.
    model = _mlp()
    for p in model.parameters():
        full = p.numel()
        p.data = torch.empty(0)
        p.ds_numel = full
    assert _rows(estimate_memory(model)) == _rows(estimate_memory(_mlp()))


def test_meta_model():
    model = nn.Sequential(nn.Linear(1000, 1000, device="meta"), nn.Linear(1000, 10, device="meta"))
    rows = estimate_memory(model)
    assert rows[0].per_cpu_bytes == int((1_001_000 + 10_010) * 18 * 1.5)
    assert rows[0].per_gpu_bytes == 4 * 1_001_000


_T5_SMALL_TABLE = """\
Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 1 node, 1 GPU per node.
SW: Model with 60M total params, 16M largest layer params.
  per CPU  |  per GPU |   Options
    1.52GB |   0.06GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1
    1.52GB |   0.06GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0
    1.35GB |   0.17GB | offload_param=none, offload_optimizer=cpu , zero_init=1
    1.35GB |   0.17GB | offload_param=none, offload_optimizer=cpu , zero_init=0
    0.09GB |   1.08GB | offload_param=none, offload_optimizer=none, zero_init=1
    0.34GB |   1.08GB | offload_param=none, offload_optimizer=none, zero_init=0
"""


def test_cold_table_matches_deepspeeds_for_t5_small(capsys):
    # t5-small's counts; DeepSpeed prints these figures for it.
    estimate_zero3_model_states_mem_needs_all_cold(60_506_624, 16_449_536)
    assert capsys.readouterr().out == _T5_SMALL_TABLE


def test_cold_table_many_gpus_and_nodes(capsys):
    estimate_zero3_model_states_mem_needs_all_cold(
        2_000_000_000, 100_000_000, num_gpus_per_node=8, num_nodes=4
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "HW: Setup with 4 nodes, 8 GPUs per node."
    assert lines[2] == "SW: Model with 2000M total params, 100M largest layer params."
    # Row 1: cpu 2e9 * 18 / 4 * 1.5 = 1.35e10 B = 12.57 GiB; gpu 4e8 B = 0.37 GiB.
    assert (
        lines[4]
        == "   12.57GB |   0.37GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1"
    )
    # Row 6: cpu 2e9 * 4 * 8 * 1.5 = 9.6e10 B = 89.41 GiB; gpu 4e8 + 18 * 2e9 / 32 = 1.525e9 B.
    assert (
        lines[9]
        == "   89.41GB |   1.42GB | offload_param=none, offload_optimizer=none, zero_init=0"
    )
    assert len(lines) == 10


def test_live_table(capsys):
    estimate_zero3_model_states_mem_needs_all_live(_mlp())
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "SW: Model with 0M total params, 0M largest layer params."
    assert lines[3] == "  per CPU  |  per GPU |   Options"
    assert (
        lines[4]
        == "    0.00GB |   0.00GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1"
    )
    assert len(lines) == 10


def test_table_printed_on_rank_zero_only(capsys, monkeypatch):
    monkeypatch.setattr(zcomm, "is_initialized", lambda: True)
    monkeypatch.setattr(zcomm, "get_rank", lambda group=None: 1)
    estimate_zero3_model_states_mem_needs_all_cold(60_506_624, 16_449_536)
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(zcomm, "get_rank", lambda group=None: 0)
    estimate_zero3_model_states_mem_needs_all_cold(60_506_624, 16_449_536)
    assert capsys.readouterr().out == _T5_SMALL_TABLE


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_gpus_per_node"):
        estimate_memory(_mlp(), num_gpus_per_node=0)
    with pytest.raises(ValueError, match="num_nodes"):
        estimate_zero3_model_states_mem_needs_all_cold(10, 1, num_nodes=0)
    with pytest.raises(ValueError, match="total_params"):
        estimate_zero3_model_states_mem_needs(-1, 0)
    with pytest.raises(ValueError, match="additional_buffer_factor"):
        estimate_zero3_model_states_mem_needs(10, 1, additional_buffer_factor=0)


def test_rows_are_frozen():
    row = estimate_memory(_mlp())[0]
    with pytest.raises(AttributeError):
        row.per_gpu_bytes = 0  # type: ignore[misc]
    assert row.options() == "offload_param=cpu , offload_optimizer=cpu , zero_init=1"


def test_zero2_bytes():
    # offloaded: 2 bytes of 16-bit params on the GPU; max(4 x 4 GPUs, 16) x 1.5 on the host
    assert estimate_zero2_model_states_mem_needs(1000, 4, 1, True) == (24000, 2000)
    # not: 2 + 18 / 4 GPUs on each GPU; 4 bytes x 4 GPUs x 1.5 on the host
    assert estimate_zero2_model_states_mem_needs(1000, 4, 1, False) == (24000, 6500)
    assert estimate_zero2_model_states_mem_needs(1000, 1, 1, True, 1.0) == (16000, 2000)
    with pytest.raises(ValueError, match="num_gpus_per_node"):
        estimate_zero2_model_states_mem_needs(1000, 0)


def test_zero2_tables(capsys):
    # DeepSpeed 0.19.8 prints these figures (its offload option reads "OffloadDeviceEnum.cpu",
    # an f-string slip; "cpu " is what its ZeRO-3 table writes)
    estimate_zero2_model_states_mem_needs_all_cold(7_000_000_000, 8, 2, 1.2)
    assert capsys.readouterr().out.splitlines() == [
        "Estimated memory needed for params, optim states and gradients for a:",
        "HW: Setup with 2 nodes, 8 GPUs per node.",
        "SW: Model with 7000M total params.",
        "  per CPU  |  per GPU |   Options",
        "  500.68GB |  13.04GB | offload_optimizer=cpu ",
        "  250.34GB |  20.37GB | offload_optimizer=none",
    ]
    estimate_zero2_model_states_mem_needs_all_live(_mlp(), 2)
    live = capsys.readouterr().out
    estimate_zero2_model_states_mem_needs_all_cold(325, 2)
    assert live == capsys.readouterr().out


def test_hybrid_sharding_spreads_the_states_over_the_shard_group():
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))  # 1,011,010 params
    total = sum(p.numel() for p in model.parameters())
    plain = estimate_memory(model, num_gpus_per_node=8, num_nodes=4)
    hybrid = estimate_memory(model, num_gpus_per_node=8, num_nodes=4, shard_size=8)
    one_node = estimate_memory(model, num_gpus_per_node=8, num_nodes=1)
    # a shard group of a node holds what one node alone would: 18 bytes / 8 GPUs, not / 32
    assert [r.per_gpu_bytes for r in hybrid] == [r.per_gpu_bytes for r in one_node]
    no_offload = hybrid[-1]
    assert no_offload.per_gpu_bytes == 4 * 1_001_000 + int(18 * total / 8)  # + largest layer
    assert plain[-1].per_gpu_bytes == 4 * 1_001_000 + int(18 * total / 32)
    # two shard groups of 4 on each node of 8: each node hosts both groups' offloaded states
    halves = estimate_memory(model, num_gpus_per_node=8, num_nodes=4, shard_size=4)
    four = estimate_memory(model, num_gpus_per_node=4, num_nodes=1)
    assert halves[0].per_cpu_bytes == 2 * four[0].per_cpu_bytes
    with pytest.raises(ValueError, match=r"shard_size=3.*must divide the 32 GPUs"):
        estimate_memory(model, num_gpus_per_node=8, num_nodes=4, shard_size=3)


def test_hpz_adds_its_secondary_shards_to_each_gpu():
    model = nn.Linear(1000, 1000)
    total = sum(p.numel() for p in model.parameters())
    plain = estimate_memory(model, num_gpus_per_node=8, num_nodes=2)
    hpz = estimate_memory(model, num_gpus_per_node=8, num_nodes=2, hpz_partition_size=8)
    for p, h in zip(plain, hpz, strict=True):
        assert h.secondary_bytes == int(2 * total / 8)
        assert h.per_gpu_bytes == p.per_gpu_bytes + h.secondary_bytes
        assert h.per_cpu_bytes == p.per_cpu_bytes
    assert all(r.secondary_bytes == 0 for r in plain)


def test_node_local_accumulation_adds_a_shard_per_node_of_every_gradient():
    model = nn.Linear(1000, 1000)
    total = sum(p.numel() for p in model.parameters())
    plain = estimate_memory(model, num_gpus_per_node=8, num_nodes=4)
    held = estimate_memory(model, num_gpus_per_node=8, num_nodes=4, node_local_accumulation=True)
    for p, h in zip(plain, held, strict=True):
        assert h.accumulation_bytes == int(2 * total / 8)  # 4 shards of 1/32: 1/8
        assert h.per_gpu_bytes == p.per_gpu_bytes + h.accumulation_bytes
    one_node = estimate_memory(model, num_gpus_per_node=8, node_local_accumulation=True)
    assert all(r.accumulation_bytes == 0 for r in one_node)  # nothing crosses a node
    with pytest.raises(ValueError, match="node_local_accumulation=True, shard_size"):
        estimate_memory(model, 8, 2, shard_size=8, node_local_accumulation=True)
