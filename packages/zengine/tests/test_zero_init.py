"""``zengine.zero.Init`` (DeepSpeed's ``deepspeed.zero.Init``) reads its DeepSpeed config through
the config layer, as ``initialize`` does: zpartition's `Init` gets the dtype, the groups, the
`ZeroParamConfig` and the store, never the config ([Note: building beyond memory])."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zengine
import zpartition
from zcomm.testing import DistributedTest
from zengine import ConfigError


def _shard_numel(module: nn.Linear) -> int:
    return int(module.weight.ds_tensor.numel())


class TestConfigRead(DistributedTest):
    world_size = 2

    def test_dtype_hjson_and_deepspeeds_positional_order(self, tmp_path: Path) -> None:
        with zengine.zero.Init(config_dict_or_path={"fp16": {"enabled": True}}):
            half = nn.Linear(3, 3)
        assert half.weight.ds_tensor.dtype == torch.float16
        # DeepSpeed's older section name, a switch written 1; `config` is the alias
        with zengine.zero.Init(config={"bfloat16": {"enabled": 1}}):
            brain = nn.Linear(3, 3)
        assert brain.weight.ds_tensor.dtype == torch.bfloat16
        with zengine.zero.Init(config={"bf16": {"enabled": True}}, dtype=torch.float32):
            kept = nn.Linear(3, 3)  # the argument wins over the config
        assert kept.weight.ds_tensor.dtype == torch.float32
        # an HJSON file (comments, unquoted keys), which initialize reads too
        rank = dist.get_rank()
        path = tmp_path / f"ds_config_{rank}.json"
        path.write_text("{\n  # DeepSpeed reads HJSON\n  bf16: {enabled: true}\n}\n")
        # DeepSpeed's positional order: module, data_parallel_group, mem_efficient_linear,
        # remote_device, pin_memory, config_dict_or_path
        with zengine.zero.Init(None, None, True, "cpu", False, str(path)):
            from_file = nn.Linear(4, 4)
        assert from_file.weight.ds_tensor.dtype == torch.bfloat16
        assert _shard_numel(from_file) == 8
        # DeepSpeed's keywords that change nothing here
        with zengine.zero.Init(
            mem_efficient_linear=False,
            zero_quantized_weights=True,
            zero_quantized_nontrainable_weights=True,
        ):
            nn.Linear(2, 2)

    def test_a_configs_problems_are_named_as_initialize_names_them(self) -> None:
        typo = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sze": 5}}
        with pytest.raises(ConfigError) as from_init:
            zengine.zero.Init(config_dict_or_path=typo)
        with pytest.raises(ConfigError) as from_initialize:
            zengine.initialize(model=nn.Linear(2, 2), config=typo)
        named = [
            [line for line in str(error.value).splitlines() if "bucket_sze" in line]
            for error in (from_init, from_initialize)
        ]
        assert named[0], named
        assert named[0] == named[1], named  # the same words for the same typo
        both = {"fp16": {"enabled": True}, "bf16": {"enabled": True}}
        with pytest.raises(ConfigError, match="fp16"):
            zengine.zero.Init(config=both)
        with pytest.raises(ConfigError, match=r'remote_device="nvme"\) needs'):
            zengine.zero.Init(remote_device="nvme", config={"zero_optimization": {"stage": 3}})
        # "auto" values take their defaults, as before a Trainer fills them
        auto = {"train_batch_size": "auto", "zero_optimization": {"reduce_bucket_size": "auto"}}
        with zengine.zero.Init(config=auto):
            built = nn.Linear(4, 4)
        assert _shard_numel(built) == 8


class TestGroupsFromConfig(DistributedTest):
    world_size = 4

    def test_mics_shard_size_and_hpz_from_the_config(self) -> None:
        # a Trainer's zero.Init (and DeepSpeed's MiCS_Init) from the config: the groups come
        # from mics_shard_size, as zpartition.hybrid_groups(2) makes them
        config = {"zero_optimization": {"stage": 3, "mics_shard_size": 2}}
        init = zengine.zero.Init(config_dict_or_path=config)
        with init:
            model = nn.Linear(6, 5)
        assert _shard_numel(model) == math.ceil(30 / 2)
        group, replicate = zpartition.hybrid_groups(2)
        assert init.group is not None
        assert init.replicate is not None
        assert dist.get_process_group_ranks(init.group) == dist.get_process_group_ranks(group)
        assert dist.get_process_group_ranks(init.replicate) == dist.get_process_group_ranks(
            replicate
        )
        # hpZ: checked before anything is built, against a node's ranks and then the group's
        hpz = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}}
        with pytest.raises(ConfigError, match="3 must divide a node's 4 ranks"):
            zengine.zero.Init(config=hpz)
        hpz["zero_optimization"]["zero_hpz_partition_size"] = 4
        with pytest.raises(zpartition.ZeroParamError, match="does not divide the 2 ranks"):
            zengine.zero.Init(config=hpz, data_parallel_group=group)
        hpz["zero_optimization"]["zero_hpz_partition_size"] = 2
        with zengine.zero.Init(config=hpz):
            nn.Linear(6, 5)
