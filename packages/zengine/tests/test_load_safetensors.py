"""`zengine.load_safetensors` against ``load_state_dict`` of the same tensors on a plain model.

Checkpoints are written with zengine's own `SafetensorsWriter` (this venv has no transformers),
the sharded form with an index json written here as Transformers writes it.
"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
import zpartition
from zcomm.testing import DistributedTest
from zengine._checkpoint import SafetensorsWriter

from ._helpers import HIDDEN, TinyGPT, global_batches, mixed_precision_losses, plain_losses

SIZES = pytest.mark.parametrize("world_size", [1, 2, 4])
SOME = pytest.mark.parametrize("world_size", [1, 2])


class Net(TinyGPT):
    """TinyGPT with buffers (one not in the state dict) and, with `tied`, the head's weight
    shared with the embedding (Transformers saves such a weight under its first name only)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(HIDDEN))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        if tied:
            self.head.weight = self.embed.weight


def checkpoint_tensors(
    model: nn.Module, dtype: torch.dtype | None = None, seed: int = 1
) -> dict[str, torch.Tensor]:
    """Fresh values for every state-dict entry of `model` (tied weights once, by first name),
    of the model's shapes; floating-point ones in `dtype` if given."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        shape = getattr(t, "ds_shape", t.shape)
        if t.is_floating_point():
            out[name] = torch.randn(shape, generator=g).to(dtype or t.dtype)
        else:
            out[name] = torch.randint(0, 100, shape, generator=g).to(t.dtype)
    return out


def write_file(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    writer = SafetensorsWriter(path, [(k, v.dtype, v.shape) for k, v in tensors.items()])
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    return path


def write_sharded(directory: Path, tensors: dict[str, torch.Tensor], shards: int = 3) -> Path:
    """Transformers' sharded form: model-0000i-of-0000n.safetensors and the index json."""
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_file(directory / file, {k: tensors[k] for k in part})
        weight_map.update(dict.fromkeys(part, file))
    index = directory / "model.safetensors.index.json"
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index


def on_rank0(directory: Path, write: Callable[[Path], Any]) -> None:
    """Rank 0 writes the checkpoint into `directory`; every rank waits for it."""
    if zcomm.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        write(directory)
    zcomm.barrier()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of `model`, partitioned or not, gathered and cloned."""
    with zpartition.GatheredParameters(list(model.parameters())):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_exact(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype, k
        assert torch.equal(got[k], expected[k]), k


def reference(
    tensors: dict[str, torch.Tensor], tied: bool = False, strict: bool = True
) -> dict[str, torch.Tensor]:
    """What ``load_state_dict`` of `tensors` gives on a plain model (seeded as the loaded one;
    a tied model's state dict has both names, the checkpoint the first)."""
    torch.manual_seed(0)
    model = Net(tied)
    model.load_state_dict(tensors, strict=strict and not tied)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def partitioned_net(how: str, tied: bool = False) -> nn.Module:
    """A Net cut by `Init` only, or built and then `partition`-ed (small parameters, the
    LayerNorms' and biases', persistent)."""
    torch.manual_seed(0)
    if how == "init":
        with zpartition.Init():
            return Net(tied)
    model = Net(tied)
    zpartition.partition(model, config=zpartition.ZeroParamConfig(param_persistence_threshold=64))
    return model


class TestLoad(DistributedTest):
    @pytest.mark.parametrize("how", ["init", "partition"])
    @pytest.mark.parametrize("form", ["file", "index", "directory"])
    @SIZES
    def test_bit_exact_with_load_state_dict(
        self, world_size: int, how: str, form: str, tmp_path: Path
    ) -> None:
        model = partitioned_net(how)
        tensors = checkpoint_tensors(Net())
        where = tmp_path / f"w{zcomm.get_world_size()}"
        if form == "file":
            on_rank0(where, lambda d: write_file(d / "model.safetensors", tensors))
            target: Path = where / "model.safetensors"
        else:
            on_rank0(where, lambda d: write_sharded(d, tensors))
            target = where / "model.safetensors.index.json" if form == "index" else where
        result = zengine.load_safetensors(model, target)
        assert result == ([], [])
        assert_bit_exact(full_state(model), reference(tensors))
        if how == "partition":  # persistent parameters hold their full values now
            norm: Any = model.blocks[0].norm.weight  # type: ignore[index]
            assert norm.ds_persist
            assert torch.equal(norm.data, tensors["blocks.0.norm.weight"])

    @pytest.mark.parametrize("how", ["init", "partition"])
    @SIZES
    def test_tied_weight_saved_once(self, world_size: int, how: str, tmp_path: Path) -> None:
        model = partitioned_net(how, tied=True)
        tensors = checkpoint_tensors(Net(tied=True))
        assert "head.weight" not in tensors  # as Transformers omits lm_head.weight
        where = tmp_path / f"w{zcomm.get_world_size()}"
        on_rank0(where, lambda d: write_sharded(d, tensors))
        result = zengine.load_safetensors(model, where)
        assert result == ([], [])
        assert_bit_exact(full_state(model), reference(tensors, tied=True))

    @pytest.mark.parametrize("dtypes", [("bf16", "fp32"), ("fp32", "bf16"), ("fp16", "bf16")])
    @SIZES
    def test_dtype_converted(
        self, world_size: int, dtypes: tuple[str, str], tmp_path: Path
    ) -> None:
        named = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        stored, held = named[dtypes[0]], named[dtypes[1]]
        torch.manual_seed(0)
        with zpartition.Init(dtype=held):
            model = Net()
        tensors = checkpoint_tensors(Net(), dtype=stored)
        where = tmp_path / f"w{zcomm.get_world_size()}-{stored}-{held}"
        on_rank0(where, lambda d: write_file(d / "model.safetensors", tensors))
        zengine.load_safetensors(model, where)
        torch.manual_seed(0)
        plain = Net()
        for p in plain.parameters():  # as Init(dtype=...): parameters only, not buffers
            p.data = p.data.to(held)
        plain.load_state_dict(tensors)  # converts as it copies, as the loader does per slice
        assert_bit_exact(full_state(model), dict(plain.state_dict()))

    @SIZES
    def test_plain_model_and_buffers(self, world_size: int, tmp_path: Path) -> None:
        model = Net()
        tensors = checkpoint_tensors(model)
        where = tmp_path / f"w{zcomm.get_world_size()}"
        on_rank0(where, lambda d: write_file(d / "model.safetensors", tensors))
        zengine.load_safetensors(model, where / "model.safetensors")
        assert_bit_exact(dict(model.state_dict()), reference(tensors))
        assert torch.equal(model.get_buffer("cache"), torch.zeros(3))  # not in the state dict


class TestErrors(DistributedTest):
    def _ready(self, tmp_path: Path) -> tuple[nn.Module, dict[str, torch.Tensor], Path]:
        model = partitioned_net("init")
        tensors = checkpoint_tensors(Net())
        return model, tensors, tmp_path / f"w{zcomm.get_world_size()}"

    @SOME
    def test_missing_file(self, world_size: int, tmp_path: Path) -> None:
        model, _, where = self._ready(tmp_path)
        with pytest.raises(FileNotFoundError, match=re.escape(str(where / "nothing"))):
            zengine.load_safetensors(model, where / "nothing")
        where.mkdir(exist_ok=True)
        with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
            zengine.load_safetensors(model, where)

    @pytest.mark.parametrize("world_size", [2])
    def test_a_rank_that_cannot_read_stops_every_rank(
        self, world_size: int, tmp_path: Path
    ) -> None:
        model, tensors, where = self._ready(tmp_path)
        on_rank0(where, lambda d: write_file(d / "model.safetensors", tensors))
        if zcomm.get_rank() == 1:  # as if its node's copy of the files were missing
            with pytest.raises(FileNotFoundError):
                zengine.load_safetensors(model, where / "elsewhere")
        else:
            with pytest.raises(zengine.CheckpointError, match="another rank could not read"):
                zengine.load_safetensors(model, where)

    @SOME
    def test_shard_named_by_index_missing(self, world_size: int, tmp_path: Path) -> None:
        model, tensors, where = self._ready(tmp_path)
        on_rank0(where, lambda d: write_sharded(d, tensors))
        zcomm.barrier()
        if zcomm.get_rank() == 0:
            (where / "model-00002-of-00003.safetensors").unlink()
        zcomm.barrier()
        with pytest.raises(zengine.CorruptCheckpointError, match="model-00002-of-00003"):
            zengine.load_safetensors(model, where)

    @SOME
    def test_corrupt_file_and_index(self, world_size: int, tmp_path: Path) -> None:
        model, tensors, where = self._ready(tmp_path)

        def write(d: Path) -> None:
            (d / "short.safetensors").write_bytes(b"\x01\x02")
            (d / "huge.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
            (d / "json.safetensors").write_bytes((4).to_bytes(8, "little") + b"{no}")
            full = write_file(d / "model.safetensors", tensors).read_bytes()
            (d / "cut.safetensors").write_bytes(full[: len(full) // 2])
            (d / "bad.index.json").write_text("{not json")

        on_rank0(where, write)
        for name, words in [
            ("short", "too short"),
            ("huge", "header"),
            ("json", "JSON"),
            ("cut", "past the end"),
            ("bad.index.json", "bad.index.json"),
        ]:
            path = where / (name if name.endswith(".json") else f"{name}.safetensors")
            with pytest.raises(zengine.CorruptCheckpointError, match=re.escape(path.name)) as e:
                zengine.load_safetensors(model, path)
            assert words in str(e.value)

    @SOME
    def test_shape_mismatch_names_tensor_file_and_shapes(
        self, world_size: int, tmp_path: Path
    ) -> None:
        model, tensors, where = self._ready(tmp_path)
        tensors["blocks.1.up.weight"] = torch.zeros(3, 5)
        on_rank0(where, lambda d: write_sharded(d, tensors))
        pattern = r"blocks\.1\.up\.weight in .*model-0000\d-of-00003\.safetensors: checkpoint "
        pattern += r"shape \(3, 5\), model shape \(64, 16\)"
        with pytest.raises(zengine.CheckpointMismatchError, match=pattern):
            zengine.load_safetensors(model, where)
        with pytest.warns(UserWarning, match=pattern):
            result = zengine.load_safetensors(model, where, strict=False)
        assert result.missing_keys == ["blocks.1.up.weight"]
        kept = {k: v for k, v in tensors.items() if k != "blocks.1.up.weight"}
        expected = reference(kept, strict=False)
        got = full_state(model)
        for k, v in expected.items():
            if k != "blocks.1.up.weight":
                assert torch.equal(got[k], v), k

    @SOME
    def test_missing_and_unexpected_keys(self, world_size: int, tmp_path: Path) -> None:
        model, tensors, where = self._ready(tmp_path)
        tensors["extra.weight"] = torch.ones(2)
        del tensors["head.bias"], tensors["steps"]
        on_rank0(where, lambda d: write_file(d / "model.safetensors", tensors))
        with pytest.raises(zengine.CheckpointMismatchError) as e:
            zengine.load_safetensors(model, where)
        message = str(e.value)
        assert "missing from the checkpoint: 'steps', 'head.bias'" in message
        assert "not in the model: 'extra.weight'" in message
        assert str(where / "model.safetensors") in message
        result = zengine.load_safetensors(model, where, strict=False)
        assert result.missing_keys == ["steps", "head.bias"]  # state-dict order, as torch's
        assert result.unexpected_keys == ["extra.weight"]
        got = full_state(model)
        assert torch.equal(got["blocks.0.up.weight"], tensors["blocks.0.up.weight"])


def _engine_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16},
    }


class TestEngine(DistributedTest):
    @SIZES
    @pytest.mark.parametrize("stage", [1, 3])
    @pytest.mark.parametrize("precision", ["fp32", "bf16"])
    def test_training_after_load_equals_the_loaded_plain_model(
        self, world_size: int, stage: int, precision: str, tmp_path: Path
    ) -> None:
        # in bf16 the fp32 masters are separate: not refreshed, the first step would
        # overwrite the loaded weights with the old ones
        config = _engine_config(stage)
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        torch.manual_seed(0)
        engine, *_ = zengine.initialize(model=TinyGPT(), config=config)
        plain = TinyGPT()
        tensors = checkpoint_tensors(plain, seed=3)
        on_rank0(tmp_path, lambda d: write_sharded(d, tensors, shards=2))
        assert zengine.load_safetensors(engine, tmp_path) == ([], [])
        for name, p in engine.module.named_parameters():
            master = zengine.safe_get_full_fp32_param(p)
            assert master is not None
            assert torch.equal(master, tensors[name].to(p.dtype).float()), name
        plain.load_state_dict(tensors)
        rank, world = zcomm.get_rank(), zcomm.get_world_size()
        data = global_batches(4, 2 * world)
        losses = []
        for tokens in data:
            loss = engine(tokens.view(world, 2, -1)[rank])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float()
            zcomm.all_reduce(mean, op=zcomm.ReduceOp.AVG)
            losses.append(mean.item())
        if rank > 0:
            return  # the losses are averaged over the ranks: rank 0's are every rank's
        if precision == "fp32":
            expected = plain_losses(plain, data, lr=1e-2)
        else:
            expected, _ = mixed_precision_losses(plain, data, torch.bfloat16, world=world)
        # bf16 against DeepSpeed's mixed precision (`mixed_precision_losses`): bit-exact on
        # one or two ranks; four ranks' bf16 gradient sums round in gloo's order, not the
        # reference's rank order (measured: 4e-4 apart at most)
        rtol = {"fp32": 1e-5, "bf16": 0.0 if world <= 2 else 2e-3}[precision]
        torch.testing.assert_close(losses, expected, rtol=rtol, atol=0)


# ---------------------------------------------------------------------------------------------
# Memory: each rank maps and copies only its own bytes


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


LAYERS, WIDTH = 48, 1024  # 48 x (1024 x 1024 + 1024) fp32: about 201 MB


class TestMemory(DistributedTest):
    world_size = 2

    def test_peak_rss_of_the_load_is_far_below_the_checkpoint(self, tmp_path: Path) -> None:
        where = tmp_path / "big"

        def write(d: Path) -> None:
            entries = [
                (f"{i}.{k}", torch.float32, s)
                for i in range(LAYERS)
                for k, s in (("weight", (WIDTH, WIDTH)), ("bias", (WIDTH,)))
            ]
            writer = SafetensorsWriter(d / "model.safetensors", entries)
            g = torch.Generator().manual_seed(0)
            for name, _, shape in entries:  # one tensor in memory at a time
                writer.write(name, torch.randn(shape, generator=g))
            writer.close()

        on_rank0(where, write)
        size = (where / "model.safetensors").stat().st_size
        with zpartition.Init():
            model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
        # The peak is measured over the load only: how much Init's construction leaves resident
        # is glibc's (freed full weights stay in the heap under its dynamic mmap threshold).
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
        baseline = _status("VmRSS")
        zengine.load_safetensors(model, where)
        extra = _status("VmHWM") - baseline
        # reading the whole file would be 1x, mapping this rank's half and keeping it 0.5x
        assert extra < 0.25 * size, f"peak RSS grew by {extra / size:.2f} x the checkpoint"
        # and the values are right (the first layer's, regenerated)
        g = torch.Generator().manual_seed(0)
        weight, bias = model[0].parameters()
        with zpartition.GatheredParameters([weight, bias]):
            assert torch.equal(weight, torch.randn((WIDTH, WIDTH), generator=g))
            assert torch.equal(bias, torch.randn((WIDTH,), generator=g))
