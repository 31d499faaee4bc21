"""Checkpoints: exact resume at every ZeRO stage, and loading at another world size."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest

from ._helpers import TinyGPT, checkpoint_config, checkpoint_engine, global_batches, train_global

README = Path(__file__).resolve().parents[1] / "README.md"
STEPS = 3  # before the save, and again after it


def train(engine: zengine.Engine, data: list[torch.Tensor]) -> list[float]:
    """This rank's share of each global batch; the losses averaged over the ranks. A little
    noise from the global RNG is added to the input, so a resume must restore the RNG too."""
    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    losses = []
    for tokens in data:
        mine = tokens.view(world, -1, tokens.shape[-1])[rank]
        mine = (mine + torch.randint(0, 2, mine.shape)) % 32
        loss = engine(mine)
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)
        losses.append(total.item())
    return losses


def resume_matches(
    stage: int,
    tmp_path: Path,
    frozen: bool = False,
    before_save: Callable[[zengine.Engine], None] | None = None,
    after_load: Callable[[zengine.Engine], None] | None = None,
    **extra: Any,
) -> None:
    """Train, save, train on; a fresh engine loads and trains the same steps bit-identically.
    `before_save` and `after_load` see the two engines at the checkpoint."""
    world = zcomm.get_world_size()
    data = global_batches(2 * STEPS, 2 * world)
    engine = checkpoint_engine(stage, frozen=frozen, **extra)
    train(engine, data[:STEPS])
    if before_save is not None:
        before_save(engine)
    engine.save_checkpoint(tmp_path, client_state={"position": STEPS, "rank": zcomm.get_rank()})
    straight = train(engine, data[STEPS:])
    # other initial weights: all must come from the file
    resumed = checkpoint_engine(stage, seed=1, frozen=frozen, **extra)
    path, client = resumed.load_checkpoint(tmp_path)
    if after_load is not None:
        after_load(resumed)
    assert path == str(tmp_path / f"global_step{STEPS}")
    assert client == {"position": STEPS, "rank": zcomm.get_rank()}
    assert resumed.global_steps == STEPS
    assert resumed.micro_steps == STEPS
    # the state in the order the optimizer made it (several ranks wrote it in another)
    assert [list(s) for s in resumed.optimizer.state.values()] == [
        list(s) for s in engine.optimizer.state.values()
    ]
    again = train(resumed, data[STEPS:])
    assert again == straight  # bit-identical, not close
    assert resumed.get_lr() == engine.get_lr()


class _CountingSGD(torch.optim.Optimizer):
    """Momentum SGD that keeps a Python int in its state, as Hugging Face's Adafactor keeps
    its step count."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["buf"] = 0, torch.zeros_like(p)
                state["step"] += 1
                state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"] / state["step"])


class TestResume(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_resume_is_bit_exact(self, stage: int, tmp_path: Path) -> None:
        resume_matches(stage, tmp_path)

    @pytest.mark.parametrize("stage", [1, 3])
    def test_optimizer_state_that_is_not_a_tensor(self, stage: int, tmp_path: Path) -> None:
        # an int in the state was lost on loading into a fresh engine (a KeyError next step)
        data = global_batches(2 * STEPS, 2 * zcomm.get_world_size())
        runs = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            model = TinyGPT()
            cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
            engine, *_ = zengine.initialize(
                model=model, optimizer=_CountingSGD(model.parameters()), config=cfg
            )
            if seed == 0:
                train(engine, data[:STEPS])
                engine.save_checkpoint(tmp_path)
            else:
                engine.load_checkpoint(tmp_path)
                assert {s["step"] for s in engine.optimizer.state.values()} == {STEPS}
            runs.append(train(engine, data[STEPS:]))
        assert runs[0] == runs[1]

    @pytest.mark.parametrize("stage", [1, 3])
    def test_frozen_parameters_are_saved(self, stage: int, tmp_path: Path) -> None:
        resume_matches(stage, tmp_path, frozen=True, bf16={"enabled": True})

    @pytest.mark.parametrize("stage", [1, 3])
    def test_module_only_loads_the_weights_alone(self, stage: int, tmp_path: Path) -> None:
        engine = checkpoint_engine(stage)
        train(engine, global_batches(STEPS, 2 * zcomm.get_world_size()))
        engine.save_checkpoint(tmp_path)
        fresh = checkpoint_engine(stage, seed=1)
        lr = fresh.get_lr()
        path, _ = fresh.load_checkpoint(tmp_path, load_module_only=True)
        assert path is not None
        for p, q in zip(engine.module.parameters(), fresh.module.parameters(), strict=True):
            mine, theirs = (zengine.safe_get_full_fp32_param(t) for t in (p, q))
            assert mine is not None
            assert theirs is not None
            assert torch.equal(mine, theirs)
        assert fresh.global_steps == 0  # no counters, no schedule, no optimizer state
        assert fresh.get_lr() == lr
        assert len(fresh.optimizer.state) == 0

    @pytest.mark.parametrize("stage", [1, 3])
    def test_frozen_left_out_resumes_not_strict(self, stage: int, tmp_path: Path) -> None:
        # exclude_frozen_parameters (Hugging Face's Trainer with PEFT): the frozen base model
        # stays out of the checkpoint and comes from where the model came from
        data = global_batches(2 * STEPS, 2 * zcomm.get_world_size())
        engine = checkpoint_engine(stage, frozen=True)
        train(engine, data[:STEPS])
        engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
        straight = train(engine, data[STEPS:])
        manifest = json.loads(next(tmp_path.glob("*/zengine.json")).read_text())
        assert manifest["frozen_excluded"]
        assert not any(name.startswith("embed.") for name in manifest["params"])
        resumed = checkpoint_engine(stage, frozen=True)  # the same base weights, untrained head
        with pytest.raises(zengine.CheckpointMismatchError, match="load_module_strict=False"):
            resumed.load_checkpoint(tmp_path)
        resumed.load_checkpoint(tmp_path, load_module_strict=False)
        assert train(resumed, data[STEPS:]) == straight

    def test_readme_example_resumes(self, tmp_path: Path) -> None:
        code = README.read_text().split("## Checkpoints", 1)[1]
        block = re.search(r"```python\n(.*?)```", code, re.S)
        assert block is not None
        os.chdir(tmp_path)  # the example's "checkpoints" directory, the same for every rank

        def run() -> str:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block.group(1), str(README), "exec"), {})
            return out.getvalue()

        assert "at step 20" in run()
        zcomm.barrier()
        if zcomm.get_rank() == 0:  # as if the job had died after step 10's checkpoint
            (tmp_path / "checkpoints" / "latest").write_text("global_step10")
        zcomm.barrier()
        assert "at step 20" in run()

    @pytest.mark.parametrize(("stage", "tiles"), [(2, False), (3, False), (3, True)])
    def test_resume_with_nvme_offload(self, stage: int, tiles: bool, tmp_path: Path) -> None:
        """Masters, optimizer state (and at stage 3 the shards) on NVMe between steps, the
        step whole or in tiles (sub_group_size): saved and loaded all the same."""
        nvme = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
        zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 16}
        zero["offload_optimizer"] = nvme
        if stage == 3:
            zero["offload_param"] = nvme
        if tiles:
            zero["sub_group_size"] = 300  # TinyGPT's shards in many tiles
        resume_matches(stage, tmp_path / "ckpt", zero_optimization=zero)

    def test_resume_bf16_stage3(self, tmp_path: Path) -> None:
        resume_matches(3, tmp_path, bf16={"enabled": True})

    def test_resume_fp16_keeps_loss_scale(self, tmp_path: Path) -> None:
        # a window of one clean step: the scale doubles at every step but the first (DeepSpeed
        # does not count the first), so a scaler that a load left at its initial state would
        # differ from the saved one
        fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1}
        saved: dict[str, Any] = {}

        def scaler(engine: zengine.Engine) -> dict[str, Any]:
            assert engine.optimizer is not None
            assert engine.optimizer.loss_scaler is not None
            return engine.optimizer.loss_scaler.state_dict()

        def same_scaler(engine: zengine.Engine) -> None:
            assert scaler(engine) == saved  # scale and counters, before any step

        resume_matches(
            2,
            tmp_path,
            fp16=fp16,
            before_save=lambda e: saved.update(scaler(e)),
            after_load=same_scaler,
        )
        assert saved["cur_scale"] == 2.0 ** (8 + STEPS - 1), saved  # changed by the steps
        assert saved["cur_iter"] == STEPS, saved

    def test_layout_is_by_name_and_latest_last(self, tmp_path: Path) -> None:
        engine = checkpoint_engine(3)
        train(engine, global_batches(1, 4))
        engine.save_checkpoint(tmp_path, tag="first")
        engine.save_checkpoint(tmp_path, tag="second")
        assert (tmp_path / "latest").read_text() == "second"
        manifest = json.loads((tmp_path / "second" / "zengine.json").read_text())
        assert manifest["world_size"] == 2
        assert manifest["zero_stage"] == 3
        assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert not list(tmp_path.glob(".*partial"))
        path, _ = engine.load_checkpoint(tmp_path, tag="first")
        assert path == str(tmp_path / "first")

    def test_ranks_save_under_one_tag(self, tmp_path: Path) -> None:
        engine = checkpoint_engine(0)
        engine.save_checkpoint(tmp_path, tag=f"mine{zcomm.get_rank()}")  # WARN: rank 0's tag
        assert (tmp_path / "latest").read_text() == "mine0"
        with pytest.raises(ValueError, match=r"'\.\./x' is not usable as a directory name"):
            engine.save_checkpoint(tmp_path, tag="../x" if zcomm.get_rank() == 1 else "ok")
        strict = checkpoint_engine(0, checkpoint={"tag_validation": "FAIL"})
        with pytest.raises(AssertionError, match="the ranks passed different tags"):  # DeepSpeed's
            strict.save_checkpoint(tmp_path, tag=f"other{zcomm.get_rank()}")
        assert (tmp_path / "latest").read_text() == "mine0"

    def test_no_save_dir_is_a_value_error(self, tmp_path: Path) -> None:
        """DeepSpeed's ValueError for an empty or missing save_dir, on every rank, before
        anything is written (an empty path is not taken for the current directory)."""
        engine = checkpoint_engine(0)
        here = os.getcwd()
        os.chdir(tmp_path)
        try:
            for save_dir in ("", None):
                with pytest.raises(ValueError, match="save_dir must be a non-empty path"):
                    engine.save_checkpoint(save_dir)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="got '' on rank 1"):
                engine.save_checkpoint(str(tmp_path / "x") if zcomm.get_rank() == 0 else "")
        finally:
            os.chdir(here)
        assert list(tmp_path.iterdir()) == []


class TestForwardOnlyEngineLoads(DistributedTest):
    """A trained model served by an engine without an optimizer (ZeRO-3 inference): its
    load_checkpoint reads the weights alone, from the masters the training saved."""

    @pytest.mark.parametrize("world_size", [1, 2, 4])
    @pytest.mark.parametrize(("saved_at", "served_at"), [(1, 3), (3, 0)])
    def test_weights_from_a_training_checkpoint(
        self, world_size: int, saved_at: int, served_at: int, tmp_path: Path
    ) -> None:
        trained = checkpoint_engine(saved_at)
        train(trained, global_batches(STEPS, 2 * world_size))
        trained.save_checkpoint(tmp_path, client_state={"note": "kept"})
        tokens = global_batches(1, 2)[0]
        with torch.no_grad():
            expected = trained(tokens)
        torch.manual_seed(1)  # other initial weights: all must come from the file
        model = TinyGPT()
        zero = {"stage": served_at, "stage3_param_persistence_threshold": 16}
        served, optimizer, *_ = zengine.initialize(
            model=model, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
        )
        assert optimizer is None
        with torch.no_grad():
            served(tokens)  # persistent parameters gathered before the load: gathered again
        path, client = served.load_checkpoint(tmp_path)  # the defaults, as DeepSpeed users call it
        assert path == str(tmp_path / f"global_step{STEPS}")
        assert client == {"note": "kept"}
        assert served.global_steps == 0  # the weights alone
        with torch.no_grad():
            torch.testing.assert_close(served(tokens), expected, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="has no optimizer"):
            served.save_checkpoint(tmp_path / "again")


class _WithEmpty(torch.nn.Module):
    """TinyGPT with a parameter and a buffer of no elements (a LoRA rank of 0, a cache)."""

    cache: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.gpt: torch.nn.Module = TinyGPT()
        self.extra = torch.nn.Parameter(torch.zeros(0, 8))
        self.register_buffer("cache", torch.zeros(0, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.gpt(tokens) + self.extra.sum() + self.cache.sum()
        return loss


class TestTensorsWithoutElements(DistributedTest):
    @pytest.mark.parametrize(
        ("world_size", "stage"), [(1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (4, 3)]
    )
    def test_train_save_load_consolidate(self, world_size: int, stage: int, tmp_path: Path) -> None:
        """As DeepSpeed: left whole (no ds_id at stage 3, nothing to step), and kept in
        checkpoints (a ZeRO-3 backward divided by their chunk of 0; their entries, of which
        DCP stores nothing, failed every load and consolidation)."""
        from zengine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        def build(seed: int) -> tuple[_WithEmpty, zengine.Engine]:
            torch.manual_seed(seed)
            model = _WithEmpty()
            engine, *_ = zengine.initialize(model=model, config=checkpoint_config(stage))
            return model, engine

        model, engine = build(0)
        assert not hasattr(model.extra, "ds_id")
        assert model.extra.shape == (0, 8)
        train(engine, global_batches(2, 2 * world_size))
        engine.save_checkpoint(tmp_path)
        fresh_model, fresh = build(1)
        fresh.load_checkpoint(tmp_path)
        assert fresh_model.extra.shape == (0, 8)
        trained = list(model.gpt.parameters())
        for p, q in zip(trained, fresh_model.gpt.parameters(), strict=True):
            mine, theirs = zengine.safe_get_full_fp32_param(p), zengine.safe_get_full_fp32_param(q)
            assert mine is not None
            assert theirs is not None
            assert torch.equal(mine, theirs)
        state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
        assert state["extra"].shape == state["cache"].shape == (0, 8)


class _Mpu:
    """DeepSpeed's model-parallel unit, here only to run an engine on some of the ranks."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_data_parallel_group(self) -> Any:
        return self.group


class TestReshard(DistributedTest):
    world_size = 4

    def test_zero3_saved_on_4_ranks_loads_on_2_and_1(self, tmp_path: Path) -> None:
        data = global_batches(STEPS + 2, 8)
        engine = checkpoint_engine(3)
        train_global(engine, data[:STEPS])
        engine.save_checkpoint(tmp_path)
        expected = train_global(engine, data[STEPS:])
        for size in (2, 1):
            group = zcomm.new_group(list(range(size)))  # every rank joins its creation
            if zcomm.get_rank() < size:
                smaller = checkpoint_engine(3, seed=5, mpu=_Mpu(group))
                smaller.load_checkpoint(tmp_path)
                assert smaller.global_steps == STEPS
                losses = train_global(smaller, data[STEPS:], group)
                torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
            zcomm.barrier()
