"""The pipeline engine at run time: nested payloads whose shapes change, evaluation, and
failures that stop every stage with an error naming the stage and the instruction."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zengine
import zpipe
from zcomm.testing import DistributedTest
from zengine.pipe import SCHEDULES, LayerSpec, PipelineEngine, PipelineError, PipelineModule

from ._helpers import (
    BASE_SEED,
    HIDDEN,
    LR,
    VOCAB,
    global_batches,
    labels_of,
    loss_fn,
    micro_batches,
    pipe_config,
    pipe_initialize,
    pipe_reference_losses,
    pipe_train,
    pipeline,
)

README = Path(__file__).resolve().parents[1] / "README.md"


class ToNest(nn.Module):
    """Tokens to a nest: a dict holding a tuple, a bool mask and a plain int."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, tokens: torch.Tensor) -> dict[str, Any]:
        h = self.embed(tokens)
        return {"pair": (h, 0.5 * h), "mask": tokens % 3 != 0, "scale": 2}


class FromNest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, VOCAB)

    def forward(self, nest: dict[str, Any]) -> torch.Tensor:
        first, second = nest["pair"]
        h = (first + nest["scale"] * second) * nest["mask"].unsqueeze(-1)
        out: torch.Tensor = self.proj(h)
        return out


def _nest_layers() -> list[Any]:
    return [LayerSpec(ToNest), LayerSpec(FromNest)]


def _nest_reference(data: list[torch.Tensor]) -> list[float]:
    layers = []
    for index, spec in enumerate(_nest_layers()):
        torch.manual_seed(BASE_SEED + index)
        layers.append(spec.build())
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for tokens in data:
        loss = loss_fn(model(tokens), labels_of(tokens))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class Boom(nn.Module):
    """Fails in its third forward."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            raise ValueError("boom")
        return x


class Swapped(zpipe.TrainSchedule):
    """TrainSchedule, but stage 1 expects micro-batch 1 before micro-batch 0: every rank
    builds the same (so the up-front check passes), yet the stages do not fit together."""

    def steps(self) -> Iterator[list[zpipe.PipeInstruction]]:
        for step in super().steps():
            out: list[zpipe.PipeInstruction] = []
            for cmd in step:
                mb = cmd.micro_batch_id
                if self.stage_id == 1 and isinstance(cmd, zpipe.RecvActivation) and mb in (0, 1):
                    cmd = zpipe.RecvActivation(cmd.buffer_id, micro_batch_id=1 - mb)
                out.append(cmd)
            yield out


class TestPayloads(DistributedTest):
    world_size = 2

    def test_nested_payloads_whose_shapes_change(self) -> None:
        for schedule in ("1f1b", "zero_bubble"):
            module = PipelineModule(
                _nest_layers(),
                num_stages=2,
                loss_fn=loss_fn,
                seed_layers=True,
                base_seed=BASE_SEED,
            )
            cfg = pipe_config(pipeline={"schedule": schedule})
            engine = pipe_initialize(module, cfg)
            # two batches of sequence length 8, then two of 5: shapes go out twice
            data = global_batches(2, 8) + [t[:, :5] for t in global_batches(2, 8, seed=3)]
            torch.testing.assert_close(
                pipe_train(engine, data), _nest_reference(data), rtol=1e-5, atol=0
            )
            assert engine.link.metas_sent == (2 if engine.stage_id == 0 else 0)


class TestData(DistributedTest):
    world_size = 2

    def test_training_data_feeds_train_batch(self) -> None:
        tokens = global_batches(1, 32)[0]
        dataset = TensorDataset(tokens, labels_of(tokens))
        losses = []
        first: DataLoader[Any] | None = None  # the first engine's loader
        for explicit in (False, True, "set_dataloader"):
            module = pipeline(2)
            engine, _, loader, _ = zengine.initialize(
                model=module,
                config=pipe_config(),
                training_data=None if explicit == "set_dataloader" else dataset,
            )
            assert isinstance(engine, PipelineEngine)
            if explicit == "set_dataloader":  # DeepSpeed's: the loader train_batch() reads
                assert first is not None
                engine.set_dataloader(first)
                losses.append([engine.train_batch().item() for _ in range(3)])
                continue
            assert loader is not None
            first = first or loader
            data = zengine.utils.RepeatingLoader(loader) if explicit else None
            losses.append([engine.train_batch(data).item() for _ in range(3 if explicit else 1)])
            if not explicit:  # the loader restarts when it ends: 16 micro-batches, 3 batches
                losses[0] += [engine.train_batch().item() for _ in range(2)]
        assert losses[0] == losses[1] == losses[2]


def test_repeating_loader_starts_again() -> None:
    repeating = zengine.utils.RepeatingLoader([1, 2])  # DeepSpeed's deepspeed.utils name
    assert iter(repeating) is repeating
    assert [next(repeating) for _ in range(5)] == [1, 2, 1, 2, 1]
    with pytest.raises(StopIteration):
        next(zengine.utils.RepeatingLoader([]))


class TestReadme(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_pipeline_example_trains(self, world_size: int) -> None:
        text = README.read_text().split("## Pipeline parallelism", 1)[1]
        code = re.search(r"```python\n(.*?)```", text, re.S)
        assert code is not None
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code.group(1), str(README), "exec"), {})
        found = re.search(r"final loss (\S+), stage (\d) of (\d)", out.getvalue())
        assert found is not None
        assert float(found.group(1)) < 0.1  # it starts near 16
        assert int(found.group(3)) == world_size


class TestEval(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("chunks", [1, 2])
    def test_eval_batch_is_the_forward_loss(self, chunks: int) -> None:
        schedule = "interleaved" if chunks > 1 else "1f1b"
        module = pipeline(2, chunks=chunks)
        engine = pipe_initialize(module, pipe_config(pipeline={"schedule": schedule}))
        data = global_batches(1, 8)
        loss, outputs = engine.eval_batch(micro_batches(data[0], 4, 1, 0), return_logits=True)
        reference = _untrained_loss(data[0])
        torch.testing.assert_close(loss.item(), reference, rtol=1e-5, atol=0)
        if engine.is_last_stage():
            assert outputs is not None
            assert len(outputs) == 4
            assert outputs[0].shape == (2, 8, VOCAB)
        else:
            assert outputs is None
        assert module.training  # eval_batch leaves the mode as it found it
        logits = engine.eval_batch(micro_batches(data[0], 4, 1, 0), compute_loss=False)
        if engine.is_last_stage():
            torch.testing.assert_close(logits, outputs)
        # training after evaluating starts from the same weights
        assert pipe_train(engine, data)[0] == pytest.approx(reference, rel=1e-5)


def _untrained_loss(tokens: torch.Tensor) -> float:
    _, model = pipe_reference_losses([])
    with torch.no_grad():
        return float(loss_fn(model(tokens), labels_of(tokens)))


class TestFailures(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("world_size", [2, 4])
    def test_a_failing_stage_stops_every_stage(self, world_size: int) -> None:
        layers: list[nn.Module] = [nn.Linear(HIDDEN, HIDDEN) for _ in range(world_size)]
        failing = world_size - 2  # the stage before the last
        layers.insert(failing + 1, Boom())
        bounds = [*range(failing + 1), failing + 2, *range(failing + 3, world_size + 2)]
        module = PipelineModule(
            layers, num_stages=world_size, partition_method=bounds, loss_fn=nn.functional.mse_loss
        )
        engine = pipe_initialize(module, pipe_config())
        x = torch.randn(2, HIDDEN)
        with pytest.raises(PipelineError) as caught:
            engine.train_batch(iter([(x, x)] * 4))
        message = str(caught.value)
        assert f"stage {failing} failed in ForwardPass(buffer_id=" in message
        assert "of micro-batch 2" in message
        assert "ValueError: boom" in message
        if engine.stage_id != failing:
            assert f"stage {engine.stage_id} stopped in" in message

    def test_stages_that_do_not_fit_together(self) -> None:
        engine = pipe_initialize(pipeline(2), pipe_config())
        engine.train_schedule_cls = Swapped
        with pytest.raises(PipelineError) as caught:
            engine.train_batch(micro_batches(global_batches(1, 8)[0], 4, 1, 0))
        message = str(caught.value)
        assert "stage 1, RecvActivation(buffer_id=0) of micro-batch 1: expected an activation" in (
            message
        )
        assert "got an activation (new shapes) of micro-batch 0 from virtual stage 0" in message
        if engine.stage_id == 0:
            assert message.startswith("stage 0 stopped in RecvGrad")

    def test_ranks_that_disagree_on_the_schedule(self) -> None:
        module = pipeline(2)
        mine = "1f1b" if module.stage_id == 0 else "gpipe"
        # in the configs, initialize names it before any stage starts
        with pytest.raises(
            zengine.RankMismatchError, match=r'pipeline\.schedule: rank 0 has "1f1b"'
        ):
            pipe_initialize(module, pipe_config(pipeline={"schedule": mine}))
        # set on the engines afterwards, the schedules' first exchange names it
        engine = pipe_initialize(pipeline(2), pipe_config())
        engine.train_schedule_cls = SCHEDULES[mine]
        with pytest.raises(PipelineError, match="the ranks disagree on the schedule") as caught:
            engine.train_batch(micro_batches(global_batches(1, 8)[0], 4, 1, 0))
        other = 1 - engine.stage_id
        assert f"stage {other} runs" in str(caught.value)
        assert "at step" in str(caught.value)
