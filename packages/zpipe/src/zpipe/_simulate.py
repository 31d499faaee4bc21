"""`simulate()`: run all stages' instructions against a cost model, event by event.

Sends are eager (the engine posts them with isend): a send costs the sender nothing and its
message arrives `comm` later; a receive waits for its message. Computations take their cost.
Costs are per stage and per micro-batch; a stage with v chunks spends 1/v of them per chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zpipe._base import PipeSchedule, build_stages
from zpipe._errors import ScheduleError
from zpipe._gc import paused_gc
from zpipe._instructions import (
    BackwardInputPass,
    BackwardPass,
    BackwardWeightPass,
    ForwardPass,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from zpipe._render import render_timeline

_KIND: dict[type[PipeInstruction], str] = {
    ForwardPass: "F",
    BackwardPass: "B",
    BackwardInputPass: "I",
    BackwardWeightPass: "W",
}
_FINAL = {"B", "W"}  # the backward pass after which an activation is freed


@dataclass(frozen=True)
class Interval:
    """One computation on one stage: from `start` to `end`."""

    start: float
    end: float
    kind: str  # "F", "B" (full backward), "I" (input gradient) or "W" (weight gradient)
    micro_batch: int | None
    chunk: int


@dataclass(frozen=True)
class Simulation:
    """The outcome of `simulate()`."""

    #: time from the first instruction to the last computation's end
    makespan: float
    #: 1 - busy time / (stages x makespan)
    bubble_fraction: float
    #: per stage, the most activations held at once, in micro-batches of the whole stage
    #: (a chunk's activation counts 1/chunks)
    peak_activations: list[float]
    #: per stage, the time spent computing
    busy: list[float]
    #: per stage, its computations in order
    timeline: list[list[Interval]]
    chunks: int

    def render(self, *, width: int | None = None) -> str:
        """A text timeline, one row per stage. See `zpipe._render.render_timeline`."""
        return render_timeline(self.timeline, self.makespan, self.chunks, width=width)


def _per_stage(name: str, value: float | Sequence[float], stages: int) -> list[float]:
    values = (
        [float(value)] * stages if isinstance(value, int | float) else [float(v) for v in value]
    )
    if len(values) != stages:
        raise ValueError(f"{name} has {len(values)} costs, one per stage needs {stages}")
    if any(v < 0 for v in values):
        raise ValueError(f"{name} must not be negative, got {value}")
    return values


@dataclass
class _Costs:
    """What each kind of computation costs on one stage, per chunk."""

    by_kind: dict[str, float]
    comm: float


def _stage_costs(
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    weight: float | Sequence[float] | None,
    comm: float,
    stages: int,
    chunks: int,
) -> list[_Costs]:
    fwd = _per_stage("forward", forward, stages)
    bwd = _per_stage("backward", backward, stages)
    if comm < 0:
        raise ValueError(f"comm must not be negative, got {comm}")
    # weight given: `backward` is the input-gradient part and a full backward costs both;
    # weight not given: `backward` is the full backward, split evenly when a schedule splits it.
    wgt = _per_stage("weight", weight, stages) if weight is not None else None
    costs = []
    for s in range(stages):
        if wgt is None:
            full, input_part, weight_part = bwd[s], bwd[s] / 2, bwd[s] / 2
        else:
            full, input_part, weight_part = bwd[s] + wgt[s], bwd[s], wgt[s]
        by_kind = {"F": fwd[s], "B": full, "I": input_part, "W": weight_part}
        costs.append(_Costs({k: v / chunks for k, v in by_kind.items()}, comm))
    return costs


@dataclass
class _Runner:
    """One stage while the simulation runs."""

    index: int
    schedule: PipeSchedule
    program: list[tuple[int, PipeInstruction]]
    costs: _Costs
    pos: int = 0
    clock: float = 0.0
    busy: float = 0.0

    def __post_init__(self) -> None:
        self.timeline: list[Interval] = []
        self.started: dict[int, float] = {}  # buffer id -> start of the forward it holds
        self.lifetimes: list[tuple[float, float]] = []

    def compute(self, cmd: PipeInstruction, kind: str) -> None:
        start, end = self.clock, self.clock + self.costs.by_kind[kind]
        self.clock, self.busy = end, self.busy + (end - start)
        self.timeline.append(Interval(start, end, kind, cmd.micro_batch_id, cmd.chunk_id))
        buffer = cmd.kwargs["buffer_id"]
        if kind == "F":
            self.started[buffer] = start
        elif kind in _FINAL and buffer in self.started:
            self.lifetimes.append((self.started.pop(buffer), end))

    def peer(self, cmd: PipeInstruction) -> int:
        virtual = self.schedule.virtual_stage(cmd.chunk_id)
        downstream = isinstance(cmd, SendActivation | RecvGrad)
        return self.schedule.owner(virtual + 1 if downstream else virtual - 1)[0]


def _advance(runner: _Runner, channels: dict[tuple[int, int], deque[float]]) -> bool:
    start = runner.pos
    while runner.pos < len(runner.program):
        cmd = runner.program[runner.pos][1]
        kind = _KIND.get(type(cmd))
        if kind is not None:
            runner.compute(cmd, kind)
        elif isinstance(cmd, SendActivation | SendGrad):
            peer = runner.peer(cmd)
            delay = runner.costs.comm if peer != runner.index else 0.0
            channels.setdefault((runner.index, peer), deque()).append(runner.clock + delay)
        elif isinstance(cmd, RecvActivation | RecvGrad):
            queue = channels.get((runner.peer(cmd), runner.index))
            if not queue:
                break
            runner.clock = max(runner.clock, queue.popleft())
        elif isinstance(cmd, ReduceTiedGrads):
            break  # a collective of all stages: released by simulate()
        runner.pos += 1
    return runner.pos != start


def _peak_of(runner: _Runner) -> int:
    """The most activations a stage holds at once: from a forward until its last backward,
    or, in a schedule without backwards, until the forward ends."""
    if any(iv.kind != "F" for iv in runner.timeline):
        return _peak(runner.lifetimes, list(runner.started.values()))
    return _peak([(iv.start, iv.end) for iv in runner.timeline], [])


def _peak(lifetimes: list[tuple[float, float]], open_starts: list[float]) -> int:
    """The most activations alive at once; one freed at t is gone before one made at t."""
    events = [(s, 1) for s, _ in lifetimes] + [(e, -1) for _, e in lifetimes]
    events += [(s, 1) for s in open_starts]
    peak = live = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def _run(schedules: list[PipeSchedule], costs: list[_Costs]) -> list[_Runner]:
    """Run all stages together until every one has finished."""
    runners = [
        _Runner(s, sched, [(i, c) for i, step in enumerate(sched) for c in step], costs[s])
        for s, sched in enumerate(schedules)
    ]
    channels: dict[tuple[int, int], deque[float]] = {}
    while True:
        progressed = False
        for runner in runners:
            progressed |= _advance(runner, channels)
        heads = [r.program[r.pos][1] if r.pos < len(r.program) else None for r in runners]
        if all(isinstance(h, ReduceTiedGrads) for h in heads):
            release = max(r.clock for r in runners)
            for runner in runners:
                runner.clock, runner.pos = release, runner.pos + 1
            progressed = True
        if not progressed:
            break
    stuck = [r for r in runners if r.pos < len(r.program)]
    if stuck:
        step, cmd = stuck[0].program[stuck[0].pos]
        raise ScheduleError(
            "the simulation cannot go on (run validate() for the cause)",
            stage=stuck[0].index,
            step=step,
            instruction=cmd,
        )
    return runners


def simulate(
    schedule_cls: type[PipeSchedule],
    micro_batches: int,
    stages: int,
    *,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    weight: float | Sequence[float] | None = None,
    comm: float = 0.0,
    **kwargs: Any,
) -> Simulation:
    """Run a schedule's instructions on all stages with these costs.

    Args:
        forward: a stage's forward time per micro-batch (one number, or one per stage).
        backward: a stage's backward time per micro-batch. Without `weight` it is the full
            backward, and a split backward costs half of it in each part.
        weight: the weight-gradient part of the backward. When given, `backward` is the
            input-gradient part alone and a full backward costs `backward + weight`.
        comm: the time a message between stages takes to arrive.
        kwargs: passed to the schedule's constructor (e.g. `chunks=2`).
    """
    schedules = build_stages(schedule_cls, micro_batches, stages, **kwargs)
    chunks = schedules[0].chunks
    costs = _stage_costs(forward, backward, weight, comm, stages, chunks)
    with paused_gc():
        runners = _run(schedules, costs)
    makespan = max((iv.end for r in runners for iv in r.timeline), default=0.0)
    busy = [r.busy for r in runners]
    total = stages * makespan
    return Simulation(
        makespan=makespan,
        bubble_fraction=1.0 - sum(busy) / total if total > 0 else 0.0,
        peak_activations=[_peak_of(r) / chunks for r in runners],
        busy=busy,
        timeline=[r.timeline for r in runners],
        chunks=chunks,
    )
