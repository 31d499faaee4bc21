"""The pipeline engine against the same model trained unsplit in one process: every schedule,
2 and 4 stages, pipe x data parallel, mixed precision, activation checkpointing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zengine.pipe import PipelineEngine, PipelineModule, TiedLayerSpec

from ._helpers import (
    PipeReference,
    WithLoss,
    global_batches,
    micro_batches,
    mixed_precision_losses,
    pipe_config,
    pipe_initialize,
    pipe_reference_losses,
    pipe_train,
    pipeline,
    tied_weights_equal,
)

STEPS = 10


def _run(
    stages: int,
    *,
    schedule: str = "1f1b",
    chunks: int = 1,
    data_parallel: int = 1,
    steps: int = STEPS,
    **extra: Any,
) -> tuple[list[float], list[float], PipelineEngine]:
    cfg = pipe_config(pipeline={"schedule": schedule}, **extra)
    module = pipeline(stages, chunks=chunks)
    engine = pipe_initialize(module, cfg)
    size = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    data = global_batches(steps, size * data_parallel)
    expected, _ = pipe_reference_losses(data, clip=float(extra.get("gradient_clipping", 0.0)))
    return pipe_train(engine, data), expected, engine


class TestParity(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize(
        ("schedule", "chunks"),
        [("1f1b", 1), ("gpipe", 1), ("zero_bubble", 1), ("interleaved", 2)],
    )
    def test_two_stages_match_one_process(self, schedule: str, chunks: int) -> None:
        losses, expected, engine = _run(2, schedule=schedule, chunks=chunks)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
        assert tied_weights_equal(engine.module)
        assert engine.global_steps == STEPS
        assert engine.link.received_ahead > 0  # gloo: receives posted before they are asked for

    def test_set_train_batch_size_runs_more_micro_batches(self) -> None:
        cfg = pipe_config(accumulation=2)
        engine = pipe_initialize(pipeline(2), cfg)
        data = global_batches(2, 4) + global_batches(2, 8, seed=8)
        losses = pipe_train(engine, data[:2])
        engine.set_train_batch_size(8)
        assert engine.micro_batches == 4
        losses += pipe_train(engine, data[2:])
        expected, _ = pipe_reference_losses(data)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)

    def test_schedules_as_written(self) -> None:
        # what NCCL runs: the sends where the schedule puts them, not moved up, and each
        # receive posted when the schedule asks for it
        data = global_batches(3, 8)
        expected, _ = pipe_reference_losses(data)
        for schedule, chunks in [("1f1b", 1), ("gpipe", 1), ("zero_bubble", 1), ("interleaved", 2)]:
            engine = pipe_initialize(
                pipeline(2, chunks=chunks), pipe_config(pipeline={"schedule": schedule})
            )
            engine.eager_sends = engine.receive_ahead = False
            torch.testing.assert_close(pipe_train(engine, data), expected, rtol=1e-5, atol=0)
            assert engine.link.received_ahead == 0
            assert engine.eval_batch(micro_batches(data[0], 4, 1, 0)).isfinite()

    @pytest.mark.world_size(4)
    @pytest.mark.parametrize(
        ("schedule", "chunks"), [("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2)]
    )
    def test_four_stages_match_one_process(self, schedule: str, chunks: int) -> None:
        # interleaved: 7 layers in 8 chunks, so one chunk is empty and passes its input on
        losses, expected, engine = _run(4, schedule=schedule, chunks=chunks)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
        assert tied_weights_equal(engine.module)

    @pytest.mark.world_size(4)
    @pytest.mark.parametrize("stage", [0, 1])
    def test_pipe_by_data_parallel(self, stage: int) -> None:
        # 2 stages x 2 replicas, clipped: the norm spans the pipeline and the data axis
        losses, expected, engine = _run(
            2,
            data_parallel=2,
            zero_optimization={"stage": stage},
            gradient_clipping=0.5,
        )
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
        # the grid is zcomm's pipe x data topology: rank = stage * 2 + replica
        rank = zcomm.get_rank()
        coord = engine.module.topology().get_coord(rank)
        assert (engine.stage_id, engine.grid.get_data_parallel_rank()) == (coord.pipe, coord.data)
        assert (engine.stage_id, engine.grid.get_data_parallel_rank()) == divmod(rank, 2)
        assert engine.grid.get_data_parallel_world_size() == 2
        assert engine.train_batch_size() == 2 * 4 * 2
        assert tied_weights_equal(engine.module)

    @pytest.mark.world_size(1)
    def test_one_stage_in_two_chunks(self) -> None:
        # chunk 0 hands its activations to chunk 1 of the same stage through a local queue
        losses, expected, _ = _run(1, schedule="interleaved", chunks=2)
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)

    @pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
    def test_activation_checkpointing(self, schedule: str) -> None:
        cfg = {"activation_checkpoint_interval": 1, "schedule": schedule}
        module = pipeline(2)
        engine = pipe_initialize(module, pipe_config(pipeline=cfg))
        assert module.activation_checkpoint_interval == 1
        data = global_batches(4, 8)
        expected, _ = pipe_reference_losses(data)
        torch.testing.assert_close(pipe_train(engine, data), expected, rtol=1e-5, atol=0)

    @pytest.mark.parametrize("precision", ["bf16", "fp16"])
    def test_half_precision_is_deepspeeds_mixed_precision(self, precision: str) -> None:
        # against `mixed_precision_losses` with the tied embedding in two copies, as the two
        # stages hold it: each micro-batch's half gradients summed in the accumulation dtype
        # (fp32 for bf16, DeepSpeed's BF16_Optimizer at ZeRO stage 0; fp16 for fp16), the
        # copies' sums added (ReduceTiedGrads), cast to the communication dtype (the half
        # one) for the reduction over the one data-parallel rank, then stepped in fp32.
        # Bit-exact on CPU: the same kernels on the same shapes, the same sums in the same
        # order.
        half: dict[str, Any] = {"enabled": True}
        if precision == "fp16":
            half |= {"loss_scale": 0, "initial_scale_power": 8}
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        cfg = pipe_config()
        cfg[precision] = half
        engine = pipe_initialize(pipeline(2), cfg)
        data = global_batches(4, 2 * 4)
        model = PipeReference(copies=True)
        expected, masters = mixed_precision_losses(
            WithLoss(model),
            data,
            dtype,
            accumulation=4,
            accumulate_dtype=torch.float32 if precision == "bf16" else None,
            fp16=half if precision == "fp16" else None,
            tied=model.tied,
        )
        torch.testing.assert_close(pipe_train(engine, data), expected, rtol=0, atol=0)
        assert next(engine.module.parameters()).dtype == engine.config.dtype
        # this stage's masters are its layers' in the reference (both copies of the tied one)
        want = dict(zip((n for n, _ in model.named_parameters()), masters, strict=True))
        for name, p in engine.module.named_parameters():
            key = "layers.0.weight" if name.startswith("tied_modules.") else f"layers.{name}"
            master = zengine.safe_get_full_fp32_param(p)
            assert master is not None
            assert torch.equal(master, want[key]), name
        assert torch.equal(want["layers.0.weight"], want["layers.6.module.weight"])


class Scale(nn.Module):
    """y = x * w, w starting at 1."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _add_weight(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tied copy on the last stage adds w: its gradient there is the loss factor."""
    assert isinstance(module, Scale)
    return x + module.weight


def _summed(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return output.float().sum()


class TestAccumulationDtype(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
    @pytest.mark.parametrize("accumulate", [None, "bf16"])
    def test_bf16_micro_batches_sum_in_fp32_by_default(
        self, schedule: str, accumulate: str | None
    ) -> None:
        # w tied across the 2 stages: loss = x * w + w, over 4 micro-batches of x = 1 and
        # 3 x 2**-9 (the loss divided by 4): stage 0's gradient 1/4 + 3 x 2**-11, which a bf16
        # running sum rounds to 1/4, stage 1's 4 x 1/4, summed over the stages (ReduceTiedGrads)
        module = PipelineModule(
            [TiedLayerSpec("w", Scale), TiedLayerSpec("w", Scale, forward_fn=_add_weight)],
            num_stages=2,
            loss_fn=_summed,
            partition_method="uniform",
        )
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 4,
            "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
            "bf16": {"enabled": True},
            "communication_data_type": "fp32",
            "pipeline": {"schedule": schedule},
        }
        if accumulate is not None:
            cfg["data_types"] = {"grad_accum_dtype": accumulate}
        engine = pipe_initialize(module, cfg)
        xs = [1.0, 2.0**-9, 2.0**-9, 2.0**-9]
        engine.train_batch(iter([(torch.tensor([[x]]).bfloat16(), torch.zeros(1)) for x in xs]))
        master = zengine.safe_get_full_fp32_param(module.tied_parameters("w")[0])
        assert master is not None
        grad = 1.0 - master.item()  # SGD, lr 1, from w = 1
        assert grad == (1.25 + 3 * 2.0**-11 if accumulate is None else 1.25), grad
