"""PipelineModule: layer specs, partitioning, tied weights, and the pipeline config (the model
and the single-process reference the test_pipe files train against are in _helpers.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zengine
import zpipe
from zcomm.testing import DistributedTest
from zengine.pipe import LayerSpec, PipelineError, PipelineModule, partition_balanced
from zengine.pipe._eager import EagerSends
from zengine.pipe._partition import partition_layers
from zengine.pipe._split import SplitBackward

from ._helpers import (
    HIDDEN,
    SEQ,
    Block,
    pipe_config,
    pipe_initialize,
    pipeline,
    specs,
    tied_weights_equal,
)

# -- partitioning --------------------------------------------------------------------------------


def test_partition_balanced_minimises_the_heaviest_part() -> None:
    assert partition_balanced([10, 100, 100, 100, 100, 10], 4) == [0, 2, 3, 4, 6]
    assert partition_balanced([1, 1, 1, 1, 1], 2) == [0, 3, 5]
    assert partition_balanced([5, 5], 4) == [0, 1, 2, 2, 2]  # fewer layers than parts


def test_partition_methods() -> None:
    layers = specs(4)  # embed, 4 blocks, norm, head
    assert partition_layers(layers, 2, "uniform") == [0, 4, 7]
    assert partition_layers(layers, 3, "type:block") == [0, 3, 6, 7]  # 2, 2 and 0 blocks
    assert partition_layers(layers, 2, [0, 1, 7]) == [0, 1, 7]
    by_params = partition_layers(layers, 2, "parameters")
    assert by_params == [0, 3, 7]  # embed + 2 blocks | 2 blocks + norm + head
    with pytest.raises(ValueError, match="no layer's class name matches 'conv'"):
        partition_layers(layers, 2, "type:conv")
    with pytest.raises(ValueError, match="2 parts need 3 boundaries"):
        partition_layers(layers, 2, [0, 7])
    with pytest.raises(ValueError, match="must rise from 0 to the number of layers"):
        partition_layers(layers, 2, [0, 5, 3])
    with pytest.raises(ValueError, match="expected 'parameters', 'uniform'"):
        partition_layers(layers, 2, "profile")


class Counted(nn.Linear):
    built = 0

    def __init__(self) -> None:
        super().__init__(HIDDEN, HIDDEN)
        Counted.built += 1


class TestModule(DistributedTest):
    world_size = 2

    def test_each_stage_builds_only_its_layers(self) -> None:
        Counted.built = 0
        layers = [LayerSpec(Counted) for _ in range(6)]
        module = PipelineModule(layers, num_stages=2, partition_method="uniform")
        assert Counted.built == 3
        assert module.parts == [0, 3, 6]
        mine = [index for index, _ in module.chunk_layers[0]]
        assert mine == ([0, 1, 2] if module.stage_id == 0 else [3, 4, 5])
        assert sum(p.numel() for p in module.parameters()) == 3 * (HIDDEN * HIDDEN + HIDDEN)

    def test_tied_layers_start_equal_and_the_copy_is_named(self) -> None:
        module = pipeline(2)
        zengine.initialize(model=module, config=pipe_config())
        assert tied_weights_equal(module)
        copies = module.tied_copies()
        assert len(copies) == (0 if module.stage_id == 0 else 1)

    def test_config_must_fit_the_module(self) -> None:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"pipeline": {"stages": 4}}, "pipeline.stages: 4, but the PipelineModule has 2"),
            ({"pipeline": {"schedule": "interleaved"}}, "needs a PipelineModule built with"),
            ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage: 2 with a Pipe"),
            ({"pipeline": {"schedul": "gpipe"}}, "did you mean 'schedule'"),
        ]
        for extra, message in cases:
            with pytest.raises(zengine.ConfigError, match=message):
                zengine.initialize(model=pipeline(2), config=pipe_config(**extra))

    def test_engine_runs_whole_batches_only(self) -> None:
        engine = pipe_initialize(pipeline(2), pipe_config())
        with pytest.raises(PipelineError, match=r"call engine\.train_batch"):
            engine(torch.zeros(1))
        assert engine.is_first_stage() == (engine.stage_id == 0)
        assert engine.train_batch_size() == 2 * 4


# -- the split backward of zero-bubble schedules ------------------------------------------------


class Twice(nn.Module):
    """A weight used twice on the input path: the split must fall back and stay exact."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(torch.tanh(self.lin(x)))
        return out


@pytest.mark.parametrize(("layer", "falls_back"), [(Block, False), (Twice, True)])
def test_split_backward_equals_full_backward(layer: type[nn.Module], falls_back: bool) -> None:
    torch.manual_seed(0)
    module = layer()
    params = list(module.parameters())
    x = torch.randn(2, SEQ, HIDDEN, requires_grad=True)
    grad = torch.randn(2, SEQ, HIDDEN)
    module(x).backward(grad)
    expected = [t.grad.clone() for t in [x, *params] if t.grad is not None]
    module.zero_grad()
    x.grad = None

    split = SplitBackward([module(x)], [grad], [x], params)
    (input_grad,) = split.input_pass()
    assert all(p.grad is None for p in params)  # the weight gradients wait
    assert split._fallback is falls_back
    split.weight_pass()
    found = [input_grad] + [p.grad for p in params]
    for got, want in zip(found, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


# -- the config section ---------------------------------------------------------------------------


def test_pipeline_config_section() -> None:
    cfg = zengine.load_config({"train_batch_size": 8}, world_size=1)
    assert cfg.pipeline.schedule == "1f1b"
    assert cfg.pipeline.stages == "auto"
    given = {"schedule": "Zero-Bubble", "stages": 4, "chunks": 2, "seed_layers": True}
    cfg = zengine.load_config({"train_batch_size": 8, "pipeline": given}, world_size=1)
    assert (cfg.pipeline.schedule, cfg.pipeline.stages, cfg.pipeline.chunks) == (
        "zero_bubble",
        4,
        2,
    )
    bad = {"schedule": "zb", "stages": 0, "p2p_timeout": -1, "activation_checkpoint": 1}
    with pytest.raises(zengine.ConfigError) as caught:
        zengine.load_config({"train_batch_size": 8, "pipeline": bad}, world_size=1)
    message = str(caught.value)
    assert "pipeline.schedule: unknown pipeline schedule 'zb'" in message
    assert "(supported: 1f1b, gpipe, interleaved, zero_bubble)" in message
    assert "pipeline.stages: must be 'auto' or at least 1, got 0" in message
    assert "pipeline.p2p_timeout" in message
    assert "did you mean 'activation_checkpoint_interval'" in message


# -- sends moved up to their computation (gloo) ---------------------------------------------------

EAGER_CASES = [
    (zpipe.TrainSchedule, {}),
    (zpipe.InferenceSchedule, {}),
    (zpipe.GPipeSchedule, {}),
    (zpipe.ZeroBubbleH1Schedule, {}),
    (zpipe.Interleaved1F1BSchedule, {"chunks": 2}),
]


@pytest.mark.parametrize(("cls", "kwargs"), EAGER_CASES)
def test_eager_sends_keep_every_channel_in_order(cls: Any, kwargs: dict[str, Any]) -> None:
    for stages, micro_batches in [(1, 3), (2, 4), (3, 5), (4, 16)]:
        for stage in range(stages):
            eager = EagerSends(micro_batches, stages, stage, base=cls, **kwargs)
            base = eager.base
            assert eager._sent([list(s) for s in eager]) == eager._sent([list(s) for s in base])
            flat = [c for step in eager for c in step]
            assert sorted(map(repr, flat)) == sorted(repr(c) for step in base for c in step)
        # never later than the schedule as written, with messages that take time
        written = zpipe.simulate(cls, micro_batches, stages, comm=0.5, **kwargs).makespan
        moved = zpipe.simulate(EagerSends, micro_batches, stages, comm=0.5, base=cls, **kwargs)
        assert moved.makespan <= written
    # DeepSpeed's 1F1B sends each activation a step late: moved up, a batch takes less
    fast = zpipe.simulate(EagerSends, 16, 4, comm=0.5, base=zpipe.TrainSchedule).makespan
    assert fast < zpipe.simulate(zpipe.TrainSchedule, 16, 4, comm=0.5).makespan
