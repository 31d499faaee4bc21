"""ZeRO-Infinity beyond memory, scaled down (issue #41): a model built under ``zero.Init`` with
``offload_param`` and ``offload_optimizer`` on NVMe, stepped in tiles (``sub_group_size``),
with activation checkpointing, trains as the same run without offload, and what the process
holds of the model's state is a few tiles, never the model: the shards while it is built and
trained, the masters and Adam's state, and the gradients (counted by the pages resident under
the gradient partition, `mincore`). The same counts taken on the run without offload exceed
the bounds, so the test fails if the model sits in memory whole. ``nox -s bench -- infinity``
trains the full size (2.3 B parameters, 1.5x the machine's memory)."""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zengine
from zcomm.testing import DistributedTest

from ._helpers import Block

VOCAB, HIDDEN, SEQ, BLOCKS = 64, 96, 8, 16
PAGE = os.sysconf("SC_PAGE_SIZE")


class _Model(nn.Module):
    """Sixteen blocks, each recomputed in backward (activation checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(BLOCKS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


_BLOCK_NUMEL = 8 * HIDDEN * HIDDEN + 7 * HIDDEN  # up, down, their biases, the norm
TILE = 2 * _BLOCK_NUMEL  # sub_group_size: two blocks a tile, about nine tiles in the model


def _config(folder: Path | None) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": TILE,
        "stage3_prefetch_bucket_size": TILE,
        # stage3_max_live_parameters and _reuse_distance at DeepSpeed's defaults (1e9): a unit
        # whose shard waits on NVMe is not kept for its reuse, whatever they allow
        "stage3_param_persistence_threshold": 4 * HIDDEN,
        "module_group_size": 0,  # a unit per module: the bounds count a few of them
    }
    if folder is not None:
        nvme = {"device": "nvme", "nvme_path": str(folder)}
        zero |= {"offload_param": nvme, "offload_optimizer": nvme}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
    }


def _resident(tensor: torch.Tensor) -> int:
    """Bytes of the pages under `tensor` that are in memory now (``mincore``)."""
    start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    lo, hi = start // PAGE * PAGE, -(-(start + nbytes) // PAGE) * PAGE
    vec = (ctypes.c_ubyte * ((hi - lo) // PAGE))()
    mincore = ctypes.CDLL(None).mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    assert mincore(lo, hi - lo, vec) == 0
    return sum(v & 1 for v in vec) * PAGE


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _train(folder: Path | None) -> tuple[list[float], dict[str, int], dict[str, int]]:
    """Build under zero.Init, train four steps; the losses, the model's full sizes, and the
    most each kind of state held in memory at any of the torch optimizer's (tile) steps."""
    config = _config(folder)
    torch.manual_seed(0)
    with zengine.zero.Init(config_dict_or_path=config):
        model = _Model()
    built = _storage_bytes([p.ds_tensor for p in model.parameters()])
    engine, *_ = zengine.initialize(model=model, config=config)
    optimizer = engine.optimizer
    assert optimizer is not None
    assert engine.partitioned is not None
    units = [u for u in engine.partitioned.units if not u.persistent]
    grads = optimizer.grad_partitions_flat_buffer
    stepped = optimizer.stepped_tensors()
    full = {
        "shards": sum(u.shard.numel() for u in units),
        "grads": grads.numel() * grads.element_size(),
        "masters": sum(t.numel() * t.element_size() for t in stepped),
    }
    held = {"built": built, "shards": 0, "grads": 0, "masters": 0, "between": 0}

    def note() -> None:
        held["shards"] = max(held["shards"], _storage_bytes([u.shard for u in units]))
        held["grads"] = max(held["grads"], _resident(grads))
        state = [*stepped]
        state += [v for t in stepped for v in optimizer.state.get(t, {}).values() if v.dim()]
        held["masters"] = max(held["masters"], _storage_bytes(state))

    step = optimizer.optimizer.step

    def watched(*args: Any, **kwargs: Any) -> Any:
        note()
        return step(*args, **kwargs)

    optimizer.optimizer.step = watched  # type: ignore[method-assign]
    for block in model.blocks:  # forward and recompute: the shards read in and ahead
        block.register_forward_pre_hook(lambda *_: note())
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if optimizer.swapper is not None:
            optimizer.swapper.wait()
        held["between"] = max(held["between"], _resident(grads))
    engine.destroy()
    return losses, full, held


class TestBeyondMemory(DistributedTest):
    @pytest.mark.parametrize("world_size", [1])
    def test_a_few_tiles_in_memory_and_the_same_losses(self, world_size: int) -> None:
        folder = Path(tempfile.mkdtemp(prefix="zengine-infinity-"))
        try:
            losses, full, held = _train(folder)
            assert not any(folder.rglob("*.bin")), "the gradient files go with the engine"
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        plain, full_plain, held_plain = _train(None)
        assert losses == plain  # bit for bit: the offload moves bytes, not values
        assert full == full_plain
        tile_shards = 2 * TILE  # bf16 shards of one tile
        tile_grads = 2 * TILE + 2 * PAGE  # bf16 gradients, and the pages at its two ends
        tile_state = 12 * TILE  # fp32 masters and Adam's two moments
        bounds = {
            "built": 0,  # each module's shard went to its file as it was cut
            # the tile stepped and the next (read ahead); in forward, the read-ahead budget
            # (a tile's elements) beside the block running
            "shards": 3 * tile_shards,
            "grads": 3 * tile_grads,  # being stepped, read ahead, and one being written
            "masters": 3 * tile_state,  # being stepped, read ahead, and the last being written
            "between": 2 * PAGE,  # handed back after each step (but the ends' partial pages)
        }
        for kind, bound in bounds.items():
            assert held[kind] <= bound, (kind, held[kind], bound, full)
            # without offload the same count is the whole model's: the bound tells them apart
            assert held_plain[kind] > bound, (kind, held_plain[kind], bound, full)
        # the bounds are well under the model's state: masters with Adam's two moments
        whole = {"shards": full["shards"], "grads": full["grads"], "masters": 3 * full["masters"]}
        for kind, nbytes in whole.items():
            assert 2 * bounds[kind] < nbytes, (kind, bounds[kind], nbytes)


class TestInitConfigs(DistributedTest):
    world_size = 1

    def test_auto_sizes_as_transformers_passes_them_before_its_trainer_fills_them(self) -> None:
        """``from_pretrained`` enters ``zero.Init`` with the config the Trainer has not yet
        completed ("auto" bucket sizes need the model): it builds, and with ``offload_param``
        on NVMe the shards are in files (the "auto" sizes take their defaults)."""
        folder = Path(tempfile.mkdtemp(prefix="zengine-init-auto-"))
        try:
            for device in ("cpu", "nvme"):
                offload = {"device": device, "nvme_path": str(folder)}
                zero = {
                    "stage": 3,
                    "reduce_bucket_size": "auto",
                    "stage3_prefetch_bucket_size": "auto",
                    "stage3_param_persistence_threshold": "auto",
                    "offload_param": offload,
                }
                config = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": zero}
                with zengine.zero.Init(config_dict_or_path=config):
                    model = nn.Linear(64, 64)
                stored = [f for f in folder.rglob("*") if f.is_file()]
                assert bool(stored) == (device == "nvme"), (device, stored)
                held = model.weight.ds_tensor.untyped_storage().nbytes()
                assert (held == 0) == (device == "nvme"), (device, held)  # the module's shard
                del model
        finally:
            shutil.rmtree(folder, ignore_errors=True)
