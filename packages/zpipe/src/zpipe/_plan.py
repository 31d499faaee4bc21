"""From per-stage compute orders to per-stage instruction steps.

A new schedule only says in which order each stage runs its computations (F, B, or the split
I and W). This module adds the communication, the loads and the buffers, and proves the result
safe by construction.

[Note: why the communication order cannot deadlock]
The compute orders are timed together once (unit costs, free communication), which gives every
message a production time. Each stage issues its sends and receives sorted by one global key,
(production time, virtual stage, micro-batch, kind). Take the unfinished message with the smallest
key: every message before it, on both its ends, is finished, so both ends reach it, and
computations never wait on anything but earlier receives. So blocking (rendezvous) point-to-point
always makes progress, and each channel is FIFO-consistent because both ends sort alike.
A message between two chunks of the same stage is a local hand-off: it never blocks.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ScheduleError
from zpipe._gc import paused_gc
from zpipe._instructions import (
    BackwardInputPass,
    BackwardPass,
    BackwardWeightPass,
    BufferOpInstruction,
    ForwardPass,
    LoadMicroBatch,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)

#: A computation in a stage's order: (kind, micro-batch, chunk), kind one of "F", "B", "I", "W".
Op = tuple[str, int, int]

PLANNING_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
_COMPUTE: dict[str, type[BufferOpInstruction]] = {
    "F": ForwardPass,
    "B": BackwardPass,
    "I": BackwardInputPass,
    "W": BackwardWeightPass,
}
#: A stage's stream before buffers are assigned: (instruction class, micro-batch, chunk).
Unbuffered = tuple[type[BufferOpInstruction], int, int]


@dataclass(frozen=True)
class Plan:
    """The instruction steps of every stage, and each stage's buffer count.

    The instructions are built once and shared by every iteration of the schedule: an engine
    iterates its schedule every batch, and rebuilding them would cost more than running them.
    """

    steps: tuple[tuple[tuple[BufferOpInstruction, ...], ...], ...]
    buffers: tuple[int, ...]


def time_orders(
    orders: Sequence[Sequence[Op]], stages: int, chunks: int, costs: dict[str, float]
) -> list[list[float]]:
    """The end time of every computation when stages run their orders as early as they can.

    Raises ScheduleError when the orders deadlock (a computation waits on one that never runs).
    """
    last = stages * chunks - 1
    # End times by what a computation makes available, keyed by (micro-batch, virtual stage):
    # the output (F) and the input gradient (B or I).
    forward_done: dict[int, float] = {}  # keyed by micro-batch * width + virtual stage
    grad_done: dict[int, float] = {}
    width = last + 1
    ends: list[list[float]] = [[] for _ in range(stages)]
    clock = [0.0] * stages
    remaining = sum(len(order) for order in orders)
    while remaining:
        before = remaining
        for stage, order in enumerate(orders):
            stage_ends, now = ends[stage], clock[stage]
            while len(stage_ends) < len(order):
                kind, mb, chunk = order[len(stage_ends)]
                vs = chunk * stages + stage
                key = mb * width + vs
                if kind == "F":
                    ready = forward_done.get(key - 1, -1.0) if vs > 0 else 0.0
                elif kind == "W":
                    ready = grad_done.get(key, -1.0)
                else:
                    ready = forward_done.get(key, -1.0)
                    if vs < last and ready >= 0:
                        grad = grad_done.get(key + 1, -1.0)
                        ready = max(ready, grad) if grad >= 0 else -1.0
                if ready < 0:
                    break
                now = max(now, ready) + costs[kind]
                if kind == "F":
                    forward_done[key] = now
                elif kind != "W":
                    grad_done[key] = now
                stage_ends.append(now)
                remaining -= 1
            clock[stage] = now
        if remaining == before:
            stuck = next(s for s, order in enumerate(orders) if len(ends[s]) < len(order))
            kind, mb, chunk = orders[stuck][len(ends[stuck])]
            raise ScheduleError(
                f"the compute orders deadlock: stage {stuck} waits to run {kind} of micro-batch "
                f"{mb} (chunk {chunk}), whose inputs never come",
                stage=stuck,
            )
    return ends


#: A send or receive, as an event of its stage: (time, 0, virtual stage, micro-batch, kind,
#: side, instruction class, chunk). Time to side is the global order of the Note above; side 1
#: puts a local hand-off's receive after its send. The 0 sorts messages before computations
#: that start at the same time.
Comm = tuple[float, int, int, int, int, int, type[BufferOpInstruction], int]


def _comm_ops(
    orders: Sequence[Sequence[Op]], ends: list[list[float]], stages: int, chunks: int
) -> list[list[Comm]]:
    """Each stage's sends and receives, each at the time its message is produced."""
    last = stages * chunks - 1
    comms: list[list[Comm]] = [[] for _ in range(stages)]
    for stage, order in enumerate(orders):
        stage_ends, out = ends[stage], comms[stage]
        for pos, (kind, mb, chunk) in enumerate(order):
            vs = chunk * stages + stage
            if kind == "F" and vs < last:
                time, target = stage_ends[pos], vs + 1
                out.append((time, 0, vs, mb, 0, 0, SendActivation, chunk))
                receiver = comms[target % stages]
                receiver.append((time, 0, vs, mb, 0, 1, RecvActivation, target // stages))
            elif kind in "BI" and vs > 0:
                time, target = stage_ends[pos], vs - 1
                out.append((time, 0, vs, mb, 1, 0, SendGrad, chunk))
                receiver = comms[target % stages]
                receiver.append((time, 0, vs, mb, 1, 1, RecvGrad, target // stages))
    return comms


def _stream(
    order: Sequence[Op],
    ends: list[float],
    comms: list[Comm],
    stage: int,
    stages: int,
    chunks: int,
) -> list[Unbuffered]:
    """Merge a stage's computations and communication into one stream, in planned time.

    A message comes at its production time, a computation at its planned start, messages
    first at equal times. So a receive precedes the computation that needs it, a send follows
    the one that makes it, the messages keep the global order, and no receive holds back a
    computation that the plan runs before the message arrives.
    """
    last = stages * chunks - 1
    events: list[tuple[Any, ...]] = list(comms)
    events += [
        (ends[pos] - PLANNING_COSTS[kind], 1, pos, kind, mb, chunk)
        for pos, (kind, mb, chunk) in enumerate(order)
    ]
    events.sort()
    stream: list[Unbuffered] = []
    for event in events:
        if event[1]:  # a computation
            _, _, _, kind, mb, chunk = event
            if kind == "F" and chunk * stages + stage in (0, last):
                stream.append((LoadMicroBatch, mb, chunk))
            stream.append((_COMPUTE[kind], mb, chunk))
        else:
            stream.append((event[6], event[3], event[7]))
    return stream


def _lower_stage(
    stream: list[Unbuffered], chunks: int
) -> tuple[tuple[tuple[BufferOpInstruction, ...], ...], int]:
    """Build the instructions, each (micro-batch, chunk) in the lowest buffer free from its
    first use to its last, grouped in steps: one computation each, with the communication
    issued just before it. Returns the steps and the most buffers in use at once."""
    keys = [mb * chunks + chunk for _, mb, chunk in stream]  # one int per (micro-batch, chunk)
    last_use = {key: i for i, key in enumerate(keys)}
    held: dict[int, int] = {}
    free: list[int] = []  # a heap
    peak = 0
    instructions: list[BufferOpInstruction] = []
    new = object.__new__
    for i, (cls, mb, chunk) in enumerate(stream):
        key = keys[i]
        buffer = held.get(key)
        if buffer is None:
            buffer = held[key] = heapq.heappop(free) if free else peak
            peak = max(peak, buffer + 1)
        if last_use[key] == i:
            heapq.heappush(free, held.pop(key))
        # What BufferOpInstruction(buffer, micro_batch_id=mb, chunk_id=chunk) makes, at less
        # than half the cost: the largest plans build a hundred thousand of these.
        cmd = new(cls)
        cmd.kwargs = {"buffer_id": buffer}
        cmd.buffer_id, cmd.micro_batch_id, cmd.chunk_id = buffer, mb, chunk
        instructions.append(cmd)
    ends = [i + 1 for i, (cls, _, _) in enumerate(stream) if cls in _COMPUTES]
    ends[-1] = len(stream)  # trailing sends belong to the last step
    steps = tuple(tuple(instructions[a:b]) for a, b in zip([0, *ends], ends, strict=False))
    return steps, peak


_COMPUTES = frozenset(_COMPUTE.values())


def build_plan(orders: Sequence[Sequence[Op]], stages: int, chunks: int) -> Plan:
    """Lower per-stage compute orders to instruction steps, buffers assigned."""
    ends = time_orders(orders, stages, chunks, PLANNING_COSTS)
    comms = _comm_ops(orders, ends, stages, chunks)
    lowered = [
        _lower_stage(_stream(order, ends[stage], comms[stage], stage, stages, chunks), chunks)
        for stage, order in enumerate(orders)
    ]
    return Plan(
        steps=tuple(steps for steps, _ in lowered), buffers=tuple(peak for _, peak in lowered)
    )


OrderFn = Callable[[int, int, int], list[list[Op]]]


@functools.lru_cache(maxsize=64)
def cached_plan(order_fn: OrderFn, micro_batches: int, stages: int, chunks: int) -> Plan:
    """The plan of a schedule family, built once for all its stages."""
    with paused_gc():
        return build_plan(order_fn(micro_batches, stages, chunks), stages, chunks)
