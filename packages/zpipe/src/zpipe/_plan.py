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

from zpipe._errors import ScheduleError
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
_COMM: dict[str, type[BufferOpInstruction]] = {
    cls.__name__: cls for cls in (SendActivation, RecvActivation, SendGrad, RecvGrad)
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
    forward_done: dict[tuple[int, int], float] = {}
    grad_done: dict[tuple[int, int], float] = {}
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
                if kind == "F":
                    ready = forward_done.get((mb, vs - 1), -1.0) if vs > 0 else 0.0
                elif kind == "W":
                    ready = grad_done.get((mb, vs), -1.0)
                else:
                    ready = forward_done.get((mb, vs), -1.0)
                    if vs < last and ready >= 0:
                        grad = grad_done.get((mb, vs + 1), -1.0)
                        ready = max(ready, grad) if grad >= 0 else -1.0
                if ready < 0:
                    break
                now = max(now, ready) + costs[kind]
                if kind == "F":
                    forward_done[(mb, vs)] = now
                elif kind != "W":
                    grad_done[(mb, vs)] = now
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


#: A send or receive before merging: (time, virtual stage, micro-batch, kind, side, instruction,
#: compute position, chunk). The first five fields are the global order of the Note above.
Comm = tuple[float, int, int, int, int, str, int, int]


def _comm_ops(
    orders: Sequence[Sequence[Op]], ends: list[list[float]], stages: int, chunks: int
) -> list[list[Comm]]:
    """Each stage's sends and receives, sorted in the global message order."""
    width = stages * chunks  # virtual stages; keys below are mb * width + virtual stage
    consumes_act: dict[int, int] = {}  # key -> position of the forward that receives it
    consumes_grad: dict[int, int] = {}  # key -> position of the backward that receives it
    for stage, order in enumerate(orders):
        for pos, (kind, mb, chunk) in enumerate(order):
            key = mb * width + chunk * stages + stage
            if kind == "F":
                consumes_act[key] = pos
            elif kind != "W":
                consumes_grad[key] = pos
    comms: list[list[Comm]] = [[] for _ in range(stages)]
    for stage, order in enumerate(orders):
        stage_ends, out = ends[stage], comms[stage]
        for pos, (kind, mb, chunk) in enumerate(order):
            vs = chunk * stages + stage
            time = stage_ends[pos]
            if kind == "F" and vs < width - 1:
                target = vs + 1
                out.append((time, vs, mb, 0, 0, "SendActivation", pos, chunk))
                recv_pos = consumes_act[mb * width + target]
                # side 1: a hand-off between chunks of one stage puts the send first
                comms[target % stages].append(
                    (time, vs, mb, 0, 1, "RecvActivation", recv_pos, target // stages)
                )
            elif kind in "BI" and vs > 0:
                target = vs - 1
                out.append((time, vs, mb, 1, 0, "SendGrad", pos, chunk))
                recv_pos = consumes_grad[mb * width + target]
                comms[target % stages].append(
                    (time, vs, mb, 1, 1, "RecvGrad", recv_pos, target // stages)
                )
    for stage_comms in comms:
        stage_comms.sort()
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

    A message comes at its key's time, a computation at its planned start, messages first at
    equal times. So a receive precedes the computation that needs it, a send follows the one
    that makes it, the messages keep the global order, and no receive holds back a
    computation that the plan runs before the message arrives.
    """
    last = stages * chunks - 1
    events: list[tuple[float, int, int, str, int, int]] = [
        (comm[0], 0, i, comm[5], comm[2], comm[7]) for i, comm in enumerate(comms)
    ]
    for pos, (kind, mb, chunk) in enumerate(order):
        start = ends[pos] - PLANNING_COSTS[kind]
        events.append((start, 1, pos, kind, mb, chunk))
    events.sort()
    stream: list[Unbuffered] = []
    for _, is_compute, _, name, mb, chunk in events:
        if is_compute and name == "F" and chunk * stages + stage in (0, last):
            stream.append((LoadMicroBatch, mb, chunk))
        stream.append((_COMPUTE[name] if is_compute else _COMM[name], mb, chunk))
    return stream


def _lower_stage(
    stream: list[Unbuffered],
) -> tuple[tuple[tuple[BufferOpInstruction, ...], ...], int]:
    """Build the instructions, each (micro-batch, chunk) in the lowest buffer free from its
    first use to its last, grouped in steps: one computation each, with the communication
    issued just before it. Returns the steps and the most buffers in use at once."""
    last_use = {(mb, chunk): i for i, (_, mb, chunk) in enumerate(stream)}
    held: dict[tuple[int, int], int] = {}
    free: list[int] = []  # a heap
    peak = 0
    steps: list[tuple[BufferOpInstruction, ...]] = []
    current: list[BufferOpInstruction] = []
    for i, (cls, mb, chunk) in enumerate(stream):
        key = (mb, chunk)
        buffer = held.get(key)
        if buffer is None:
            buffer = held[key] = heapq.heappop(free) if free else peak
            peak = max(peak, buffer + 1)
        current.append(cls(buffer, micro_batch_id=mb, chunk_id=chunk))
        if last_use[key] == i:
            heapq.heappush(free, held.pop(key))
        if cls in _COMPUTES:
            steps.append(tuple(current))
            current = []
    if current:  # trailing sends belong to the last step
        steps[-1] = steps[-1] + tuple(current)
    return tuple(steps), peak


_COMPUTES = frozenset(_COMPUTE.values())


def build_plan(orders: Sequence[Sequence[Op]], stages: int, chunks: int) -> Plan:
    """Lower per-stage compute orders to instruction steps, buffers assigned."""
    ends = time_orders(orders, stages, chunks, PLANNING_COSTS)
    comms = _comm_ops(orders, ends, stages, chunks)
    lowered = [
        _lower_stage(_stream(order, ends[stage], comms[stage], stage, stages, chunks))
        for stage, order in enumerate(orders)
    ]
    return Plan(
        steps=tuple(steps for steps, _ in lowered), buffers=tuple(peak for _, peak in lowered)
    )


OrderFn = Callable[[int, int, int], list[list[Op]]]


@functools.lru_cache(maxsize=64)
def cached_plan(order_fn: OrderFn, micro_batches: int, stages: int, chunks: int) -> Plan:
    """The plan of a schedule family, built once for all its stages."""
    return build_plan(order_fn(micro_batches, stages, chunks), stages, chunks)
