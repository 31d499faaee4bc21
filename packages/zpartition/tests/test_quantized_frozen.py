"""Quantized frozen weights (ZeRO++'s MixZ++, ``quantized_nontrainable_weights``): frozen units
kept as int8 codes (a quarter of the memory), gathered as codes (a quarter of the bytes), and
training exactly as plain PyTorch with the frozen weights dequantized; writes to a frozen
shard kept; bad input named."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
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
    link_bytes,
    nodes_of,
    reference_losses,
    same_on_every_rank,
    train_partitioned,
)

BLOCK = 64
BASE: dict[str, Any] = {**REGATHERED, "quantized_weights_block_size": BLOCK}


def _lora_like(seed: int = 0) -> TinyGPT:
    """TinyGPT with every block's linear layers frozen, as LoRA's base: their units hold no
    trainable parameter; the embedding, the norms and the bias train."""
    torch.manual_seed(seed)
    model = TinyGPT()
    for name, p in model.named_parameters():
        p.requires_grad_(".up." not in name and ".down." not in name)
    return model


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value, as a gather outside the passes gives it."""
    params = dict(model.named_parameters())
    with zpartition.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


class TestTraining(DistributedTest):
    @pytest.mark.parametrize("world_size", [2, 4])
    def test_frozen_units_are_codes_and_training_is_exact_with_their_values(
        self, world_size: int
    ) -> None:
        data = batches(3, 4 * world_size)
        built = _lora_like()
        model = copy.deepcopy(built)
        handle = zpartition.partition(
            model, config=ZeroParamConfig(**BASE, quantized_nontrainable_weights=True)
        )
        frozen = [u for u in handle.units if u.codes is not None]
        assert sorted(u.name for u in frozen) == sorted(
            f"blocks.{i}.{m}" for i in range(3) for m in ("up", "down")
        )
        assert all(not u.trainable and not u.persistent for u in frozen)
        for u in frozen:
            # released: the exact shard's memory is gone; the codes take a quarter of it
            # (its elements padded to whole blocks, and a float32 scale per block)
            assert u.shard.untyped_storage().nbytes() == 0
            padded = -(-u.shard.numel() // 4 // BLOCK) * BLOCK
            assert u.codes.nbytes == zcomm.quantized_nbytes(padded, bits=8, block_size=BLOCK)
            assert u.codes.nbytes < 0.3 * u.shard.numel()

        # the frozen weights are their dequantized values now, alike on every rank, each
        # within half a block's scale of what was built and not all equal to it
        values = _full(model)
        handle.fetch_shards()  # a shard read: the codes' values, this rank's slice of them
        for name, p in model.named_parameters():
            assert same_on_every_rank(values[name])
            original = built.get_parameter(name).detach()
            if p.requires_grad:
                assert torch.equal(values[name], original), name
                continue
            n, rank = p.ds_tensor.numel(), zcomm.get_rank()
            mine = values[name].reshape(-1)[rank * n : (rank + 1) * n]
            assert torch.equal(p.ds_tensor[: mine.numel()], mine)
            scale = original.abs().max() / 127  # at most any block's scale
            assert bool(((values[name] - original).abs() <= scale / 2 * 1.001).all()), name
        assert any(not torch.equal(values[n], built.get_parameter(n)) for n in values)
        handle.evict_shards()
        assert all(u.shard.untyped_storage().nbytes() == 0 for u in frozen)

        # training: exactly plain PyTorch on a model whose frozen weights are those values;
        # the codes never change
        reference = copy.deepcopy(built)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(values[name])
        expected = reference_losses(reference, data, 0.1)
        codes = [u.codes.codes for u in frozen]
        losses = train_partitioned(model, handle.shard_parameters(), data, 0.1)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
        assert [u.codes.codes for u in frozen] == codes  # the same objects: not re-encoded
        handle.remove(gather=False)

        # with hpZ at 2 x 2 the backward gathers the forward's values within the node
        if world_size == 4:
            hpz = copy.deepcopy(built)
            config = ZeroParamConfig(
                **BASE, quantized_nontrainable_weights=True, secondary_partition_size=2
            )
            with nodes_of(2):
                h = zpartition.partition(hpz, config=config)
                got = train_partitioned(hpz, h.shard_parameters(), data, 0.1)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

        # off: nothing changes, bit for bit
        plain, off = copy.deepcopy(built), copy.deepcopy(built)
        runs = []
        for m, flag in ((plain, None), (off, False)):
            extra: dict[str, Any] = {}
            if flag is not None:
                extra["quantized_nontrainable_weights"] = flag
            h = zpartition.partition(m, config=ZeroParamConfig(**BASE, **extra))
            assert all(u.codes is None for u in h.units)
            runs.append(train_partitioned(m, h.shard_parameters(), data, 0.1))
        assert runs[0] == runs[1]


class TestCodes(DistributedTest):
    world_size = 2

    def test_a_gather_sends_the_codes(self) -> None:
        # 64 x 64 layers, all frozen: each rank's shard is 2048 + 32 fp32 elements, 4 blocks
        world, block = 2, 520

        def forward_bytes(quantized: bool) -> int:
            torch.manual_seed(0)
            model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3))).requires_grad_(False)
            config = ZeroParamConfig(
                param_persistence_threshold=0,
                prefetch_bucket_size=0,
                quantized_nontrainable_weights=quantized,
                quantized_weights_block_size=block,
            )
            zpartition.partition(model, config=config)
            sent = link_bytes(lambda: model(torch.randn(4, 64)))
            intra, inter = sent["all_gather_into_tensor"]
            assert inter == 0
            return intra

        headers = 3 * HEADER * world  # one agreement per unit fetched
        exact, codes = forward_bytes(False), forward_bytes(True)
        assert exact - headers == 3 * world * 2080 * 4
        per_rank = zcomm.quantized_nbytes(2080, bits=8, block_size=block)  # 2080 + 16 bytes
        assert codes - headers == 3 * world * per_rank

    def test_a_unit_smaller_than_a_block_is_one_block_of_its_size(self) -> None:
        # Linear(8, 8): each rank's shard is 32 + 4 fp32 elements (144 bytes), far below the
        # default block of 2048: its codes and the gathers of qwZ and MixZ++ carry 36 bytes
        # and one scale, not a block's 2048
        world, per_rank = 2, zcomm.quantized_nbytes(36, bits=8, block_size=36)

        def forward_bytes(frozen: bool = False, **flags: Any) -> int:
            model = nn.Linear(8, 8).requires_grad_(not frozen)
            config = ZeroParamConfig(param_persistence_threshold=0, **flags)
            handle = zpartition.partition(model, config=config)
            (unit,) = handle.units
            if unit.codes is not None:
                assert unit.codes.nbytes == per_rank
            sent = link_bytes(lambda: model(torch.randn(2, 8)))
            handle.remove(gather=False)
            return sent["all_gather_into_tensor"][0] - HEADER * world

        assert forward_bytes() == world * 144
        assert forward_bytes(quantized_weights=True) == world * per_rank
        assert forward_bytes(True, quantized_nontrainable_weights=True) == world * per_rank

    def test_writes_to_a_frozen_shard_are_kept(self) -> None:
        model = _lora_like()
        handle = zpartition.partition(
            model, config=ZeroParamConfig(**BASE, quantized_nontrainable_weights=True)
        )
        weight = model.get_parameter("blocks.0.up.weight")
        unit = weight.ds_unit
        before = _full(model)["blocks.0.up.weight"]

        # the same values written back (a checkpoint of this run loaded): the codes stay
        codes = unit.codes.codes
        weight.ds_tensor.copy_(_mine(weight, before))
        assert unit.codes.codes is codes
        assert unit.shard.untyped_storage().nbytes() == 0  # put away again

        # new values: quantized again, and the next gather gives their dequantized values
        new = torch.linspace(-1, 1, weight.ds_numel).view(weight.ds_shape)
        weight.ds_tensor.copy_(_mine(weight, new))
        assert unit.codes.codes is not codes
        after = _full(model)["blocks.0.up.weight"]
        assert same_on_every_rank(after)
        assert not torch.equal(after, before)
        assert (after - new).abs().max() <= 1 / 127  # half a scale of absmax 1, with room

        # and through GatheredParameters with a modifier: kept as codes of the new values
        with zpartition.GatheredParameters([weight], modifier_rank=0), torch.no_grad():
            weight.mul_(-2)
        assert unit.shard.untyped_storage().nbytes() == 0
        modified = _full(model)["blocks.0.up.weight"]
        assert same_on_every_rank(modified)
        assert (modified + 2 * after).abs().max() <= 2 / 127
        handle.remove(gather=False)

    def test_bad_input_is_named(self) -> None:
        model = _lora_like()
        with torch.no_grad():
            model.get_parameter("blocks.1.down.weight")[0, 0] = float("nan")
        config = ZeroParamConfig(**BASE, quantized_nontrainable_weights=True)
        with pytest.raises(ZeroParamError, match=r"'blocks.1.down.weight' has 1 non-finite"):
            zpartition.partition(model, config=config)
        assert not hasattr(model.get_parameter("blocks.1.down.weight"), "ds_tensor")  # untouched
        handle = zpartition.partition(_lora_like(), config=ZeroParamConfig(**BASE))
        trainable = next(u for u in handle.units if u.trainable)
        with pytest.raises(ZeroParamError, match=f"{trainable.name!r} is not a frozen unit"):
            trainable.store_quantized(BLOCK)


def _mine(param: Any, full: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of `full` as `param`'s ``ds_tensor`` holds it (padded)."""
    n, rank = param.ds_tensor.numel(), zcomm.get_rank()
    chunk = torch.zeros(n, dtype=full.dtype)
    part = full.reshape(-1)[rank * n : (rank + 1) * n]
    chunk[: part.numel()] = part
    return chunk
