"""A run DeepSpeed checkpointed continues on zstack: ``load_checkpoint`` of DeepSpeed's folders.

The fixtures were written by the real DeepSpeed 0.19.8 (`deepspeed_checkpoints/make.py`, with
the losses it trained before the save and continuing after it). zstack loads each at the world
size that saved it and at others, and continues: its losses must match DeepSpeed's continuation
as closely as the two engines match each other from the same start (`own`, measured here on the
same steps): a loaded run at most ``2 * own + 1e-5`` from DeepSpeed's. The fp32 runs agree to
~1e-5, bf16 and fp16 to their own precision's difference.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zengine import _cli as cli
from zengine._checkpoint import CheckpointMismatchError, CorruptCheckpointError
from zengine._checkpoint._errors import UnsafeCheckpointError
from zengine.pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec
from zengine.utils import safe_get_full_fp32_param
from zengine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from . import _ds_fixture as fx

BEFORE, AFTER = fx.STEPS_BEFORE, fx.STEPS_AFTER
TAG = f"global_step{BEFORE}"


def engine(config: dict[str, Any], model: torch.nn.Module | None = None) -> zengine.Engine:
    m = model if model is not None else fx.model()
    eng, *_ = zengine.initialize(model=m, model_parameters=fx.param_groups(m), config=config)
    return eng


def train(eng: zengine.Engine, data: list[torch.Tensor]) -> list[float]:
    """Each step's loss, the mean over the ranks (each rank trains its share of the batch)."""
    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    out = []
    for tokens in data:
        loss = eng(fx.local(tokens, rank, world))
        eng.backward(loss)
        eng.step()
        mean = loss.detach().float().reshape(1).clone()
        zcomm.all_reduce(mean)
        out.append(mean.item() / world)
    return out


def largest_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def continues_as_deepspeed(
    case: str, config: dict[str, Any], load: str | Path, tag: str | None = None
) -> zengine.Engine:
    """Load `load` into a fresh engine of `config`, train on, and compare with DeepSpeed's
    continuation of `case`; the loaded engine after its steps."""
    data = fx.batches(BEFORE + AFTER)
    recorded = fx.losses(case)
    own = largest_gap(train(engine(config), data)[BEFORE:], recorded["after"])
    loaded = engine(config)
    path, client = loaded.load_checkpoint(load, tag)
    assert path is not None
    assert client is not None
    assert Path(path).name.startswith(TAG)
    assert (client["epoch"], client["note"]) == (1, "written by DeepSpeed")
    assert (loaded.global_steps, loaded.global_samples) == (BEFORE, BEFORE * fx.GLOBAL_BATCH)
    assert loaded.lr_scheduler is not None
    assert loaded.lr_scheduler.state_dict() == {"last_batch_iteration": BEFORE - 1}
    steps = {float(s["step"]) for s in loaded.optimizer.state.values() if "step" in s}
    assert steps
    assert min(steps) >= BEFORE
    gap = largest_gap(train(loaded, data[BEFORE:]), recorded["after"])
    assert gap <= 2 * own + 1e-5, f"{case}: {gap} from DeepSpeed's losses (engines apart: {own})"
    return loaded


class TestContinueDeepSpeedRuns(DistributedTest):
    @pytest.mark.parametrize("case", sorted(fx.CASES))
    def test_at_the_world_size_that_saved(self, case: str) -> None:
        self.world_size = fx.CASES[case][2]
        continues_as_deepspeed(case, fx.config(case), fx.FIXTURES / case)

    @pytest.mark.parametrize(
        ("world_size", "case"),
        [
            (1, "stage3_fp32_ws2"),
            (4, "stage3_fp32_ws2"),
            (1, "stage2_fp32_ws4"),
            (2, "stage2_fp32_ws4"),
            (2, "stage3_fp32_ws4"),
            (4, "stage1_bf16_ws2"),
            (1, "stage3_fp16_ws2"),
            (4, "stage2_offload_ws2"),
        ],
    )
    def test_at_another_world_size(self, world_size: int, case: str) -> None:
        continues_as_deepspeed(case, fx.config(case, world_size), fx.FIXTURES / case)

    @pytest.mark.parametrize(("world_size", "stage"), [(2, 1), (2, 2), (1, 0), (4, 3)])
    def test_at_another_zero_stage(self, world_size: int, stage: int) -> None:
        """DeepSpeed's stage-3 save, continued at another stage (DeepSpeed cannot)."""
        config = fx.config("stage3_fp32_ws2", world_size)
        config["zero_optimization"]["stage"] = stage
        continues_as_deepspeed("stage3_fp32_ws2", config, fx.FIXTURES / "stage3_fp32_ws2")

    @pytest.mark.parametrize(
        ("world_size", "case"),
        [(2, "stage3_fp32_ws2"), (1, "stage3_bf16_ws2"), (4, "stage2_fp32_ws2")],
    )
    def test_a_universal_checkpoint(self, world_size: int, case: str) -> None:
        """``ds_to_universal``'s folder: through ``latest_universal`` with DeepSpeed's
        ``checkpoint.load_universal``, and by its tag."""
        config = fx.config(case, world_size)
        config["checkpoint"] = {"load_universal": True}
        continues_as_deepspeed(case, config, fx.FIXTURES / case)
        continues_as_deepspeed(
            case, fx.config(case, world_size), fx.FIXTURES / case, TAG + "_universal"
        )


def pipe_engine(case: str, stages: int, data_parallel: int) -> PipelineEngine:
    module = PipelineModule(
        fx.pipe_specs(LayerSpec, TiedLayerSpec),
        num_stages=stages,
        loss_fn=fx.pipe_loss,
        seed_layers=True,
        base_seed=fx.PIPE_BASE_SEED,
        partition_method="uniform",
    )
    eng, *_ = zengine.initialize(model=module, config=fx.pipe_config(case, data_parallel))
    assert isinstance(eng, PipelineEngine)
    return eng


def pipe_train(eng: PipelineEngine, data: list[torch.Tensor]) -> list[float]:
    accumulation = eng.gradient_accumulation_steps()
    dp, rank = eng.grid.get_data_parallel_world_size(), eng.grid.get_data_parallel_rank()
    return [
        eng.train_batch(iter(fx.pipe_micro_batches(t, accumulation, dp, rank))).item() for t in data
    ]


class TestContinueDeepSpeedPipelines(DistributedTest):
    """DeepSpeed's pipeline checkpoints (layer files, a model-states and optimizer file per
    stage) into zstack's pipeline engine: the same stages, other data-parallel sizes, other
    stage counts."""

    @pytest.mark.parametrize(
        ("world_size", "case", "stages"),
        [
            (4, "pipe_stage1_pp2_dp2", 2),
            (2, "pipe_stage1_pp2_dp2", 2),
            (4, "pipe_stage1_pp2_dp2", 4),
            (1, "pipe_stage1_pp2_dp2", 1),
            (2, "pipe_stage0_pp2_dp1", 2),
        ],
    )
    def test_continues(self, world_size: int, case: str, stages: int) -> None:
        data = fx.batches(BEFORE + AFTER)
        recorded = fx.losses(case)
        dp = world_size // stages
        own = largest_gap(
            pipe_train(pipe_engine(case, stages, dp), data)[BEFORE:], recorded["after"]
        )
        loaded = pipe_engine(case, stages, dp)
        path, client = loaded.load_checkpoint(fx.FIXTURES / case)
        assert path == str(fx.FIXTURES / case / TAG)
        assert client is not None
        assert client["epoch"] == 1
        assert loaded.global_steps == BEFORE
        gap = largest_gap(pipe_train(loaded, data[BEFORE:]), recorded["after"])
        assert gap <= 2 * own + 1e-5, f"{case}: {gap} from DeepSpeed's losses (apart: {own})"


class TestUniversalRoundTrip(DistributedTest):
    """zstack's own universal export (``save_checkpoint(universal=True)``) read back by zstack,
    at another ZeRO stage: the masters, moments and steps come through exactly; `latest` still
    resumes zstack's checkpoint, ``load_universal`` takes the export."""

    world_size = 2

    @pytest.mark.parametrize(("saved", "loaded"), [(3, 1), (1, 3)])
    def test_continues_the_run(self, saved: int, loaded: int, tmp_path: Path) -> None:
        data = fx.batches(BEFORE + AFTER)
        config = fx.config(f"stage{saved}_fp32_ws2")
        trained = engine(config)
        train(trained, data[:BEFORE])
        trained.save_checkpoint(tmp_path, universal=True)
        straight = train(trained, data[BEFORE:])
        other = fx.config("stage1_fp32_ws2")
        other["zero_optimization"]["stage"] = loaded
        other["checkpoint"] = {"load_universal": True}
        resumed = engine(other)
        path, _ = resumed.load_checkpoint(tmp_path)
        assert path == str(tmp_path / f"{TAG}_universal")
        assert largest_gap(train(resumed, data[BEFORE:]), straight) <= 1e-5


class TestLoadOptions(DistributedTest):
    world_size = 2

    def test_fp16_loss_scale_comes_along(self) -> None:
        case = "stage3_fp16_ws2"
        loaded = engine(fx.config(case))
        loaded.load_checkpoint(fx.FIXTURES / case)
        scaler = loaded.optimizer.loss_scaler
        assert scaler is not None
        assert (scaler.cur_scale, scaler.cur_iter) == (512.0, BEFORE)

    @pytest.mark.parametrize("stage", [1, 3])
    def test_module_only(self, stage: int) -> None:
        """The weights alone: the masters equal the checkpoint's, the counters stay 0."""
        case = f"stage{stage}_fp32_ws2"
        loaded = engine(fx.config(case))
        loaded.load_checkpoint(fx.FIXTURES / case, load_module_only=True)
        assert loaded.global_steps == 0
        assert not any(loaded.optimizer.state.values())
        saved = get_fp32_state_dict_from_zero_checkpoint(fx.FIXTURES / case)
        for name, p in loaded.module.named_parameters():
            full = safe_get_full_fp32_param(p) if p.requires_grad else None
            if full is not None:
                torch.testing.assert_close(full, saved[name], rtol=0, atol=0)

    def test_without_the_optimizer_state(self) -> None:
        case = "stage2_fp32_ws2"
        loaded = engine(fx.config(case))
        loaded.load_checkpoint(fx.FIXTURES / case, load_optimizer_states=False)
        assert loaded.global_steps == BEFORE
        assert not any(loaded.optimizer.state.values())

    def test_another_model_is_named(self) -> None:
        """Every rank raises, naming what differs."""
        case = "stage3_fp32_ws2"
        other = fx.model()
        other.extra = torch.nn.Linear(2, 2)
        with pytest.raises(CheckpointMismatchError, match=r"extra\.weight"):
            engine(fx.config(case), other).load_checkpoint(fx.FIXTURES / case)

    def test_expert_parallel_files_are_refused(self, tmp_path: Path) -> None:
        """An MoE save's expert files (where DeepSpeed's ``_get_optimizer_ckpt_name`` points):
        zstack has no expert parallelism, and says so rather than loading part of the model."""
        case = "stage2_fp32_ws2"
        copy = tmp_path / case
        loaded = engine(fx.config(case))
        expert = loaded._get_optimizer_ckpt_name(copy, TAG, 1)
        assert expert == str(copy / TAG / "expp_rank_1_mp_rank_00_optim_states.pt")
        if zcomm.get_rank() == 0:
            shutil.copytree(fx.FIXTURES / case, copy)
            shutil.copy(copy / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt", expert)
        zcomm.barrier()
        with pytest.raises(CheckpointMismatchError, match="expert-parallel"):
            loaded.load_checkpoint(copy)

    def test_a_missing_rank_file_is_named(self, tmp_path: Path) -> None:
        case = "stage2_fp32_ws2"
        copy = tmp_path / case
        if zcomm.get_rank() == 0:
            shutil.copytree(fx.FIXTURES / case, copy)
            (copy / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
        zcomm.barrier()
        with pytest.raises(CorruptCheckpointError, match="1 optimizer state files for the 2"):
            engine(fx.config(case)).load_checkpoint(copy)


class Payload:
    """What a malicious checkpoint would carry: unpickling it would create a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


class TestNothingRuns(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize(
        "planted", ["payload", "namespace"], ids=["a __reduce__ payload", "argparse.Namespace"]
    )
    def test_a_planted_object_is_refused_by_name(self, planted: str, tmp_path: Path) -> None:
        case = "stage3_fp32_ws2"
        copy, marker = tmp_path / case, tmp_path / "ran"
        target = copy / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        if zcomm.get_rank() == 0:
            shutil.copytree(fx.FIXTURES / case, copy)
            states = torch.load(target, weights_only=True)
            value = Payload(str(marker)) if planted == "payload" else argparse.Namespace(lr=1)
            torch.save({**states, "args": value}, target)
        zcomm.barrier()
        asked = "posix.mkdir" if planted == "payload" else "argparse.Namespace"
        with pytest.raises(UnsafeCheckpointError, match=f"{target.name} asks for .*{asked}"):
            engine(fx.config(case)).load_checkpoint(copy)
        with pytest.raises(UnsafeCheckpointError, match=asked):
            get_fp32_state_dict_from_zero_checkpoint(copy)
        assert not marker.exists()


class TestConsolidate(DistributedTest):
    world_size = 1

    @pytest.mark.parametrize("case", ["stage1_bf16_ws2", "stage3_fp32_ws4", "stage3_bf16_ws2"])
    def test_equals_the_loaded_engine(self, case: str, tmp_path: Path) -> None:
        """``zengine consolidate`` of DeepSpeed's folder gives the masters an engine loads."""
        out = tmp_path / "model.pt"
        assert cli.main(["consolidate", str(fx.FIXTURES / case), str(out)]) == 0
        state = torch.load(out, weights_only=True)
        assert state["head.weight"] is state["embed.weight"]  # tied, one storage
        loaded = engine(fx.config(case, 1))
        loaded.load_checkpoint(fx.FIXTURES / case)
        for name, p in loaded.module.named_parameters():
            held = safe_get_full_fp32_param(p) if p.requires_grad else None
            if held is not None:
                torch.testing.assert_close(state[name], held, rtol=0, atol=0)
        buffers = dict(loaded.module.named_buffers())
        position = buffers["position"]  # the engine keeps it in the compute dtype
        torch.testing.assert_close(state["position"].to(position.dtype), position)

    def test_stage0_module_weights(self) -> None:
        """A stage-0 save names no masters: its module's weights (DeepSpeed's own
        zero_to_fp32 refuses stage 0)."""
        state = get_fp32_state_dict_from_zero_checkpoint(fx.FIXTURES / "stage0_fp32_ws2")
        assert set(state) == set(fx.model().state_dict())

    def test_a_pipeline_folder_is_named(self) -> None:
        """DeepSpeed's pipeline checkpoint names its layers by index: only a pipeline engine
        knows their names (a tied layer's), so neither an engine of one stage nor the offline
        tools take it."""
        folder = fx.FIXTURES / "pipe_stage1_pp2_dp2"
        with pytest.raises(CheckpointMismatchError, match="DeepSpeed's pipeline engine"):
            get_fp32_state_dict_from_zero_checkpoint(folder)
        with pytest.raises(CheckpointMismatchError, match=r"zengine\.pipe\.PipelineEngine"):
            engine(fx.config("stage1_fp32_ws2", 1)).load_checkpoint(folder)

    def test_a_folder_of_neither_kind_is_named(self, tmp_path: Path) -> None:
        (tmp_path / "global_step3").mkdir()
        (tmp_path / "global_step3" / "weights.bin").write_bytes(b"\0")
        (tmp_path / "latest").write_text("global_step3")
        with pytest.raises(CorruptCheckpointError, match=r"neither zstack's .* nor DeepSpeed's"):
            get_fp32_state_dict_from_zero_checkpoint(tmp_path)
