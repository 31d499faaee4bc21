"""`validate()`: run every stage's instructions together and prove the schedule safe.

Point-to-point is blocking (rendezvous): a send completes only with the matching receive, as
with NCCL or gloo without buffering. Each pair of stages has one FIFO channel, since NCCL
matches messages between two ranks in order and ignores tags: a receive of the wrong kind is an
error. A hand-off between two chunks of the same stage is local and never blocks.

What a buffer holds is tracked from what really flows into it (loads count micro-batches, a
receive gets what the peer sent), not from the instructions' annotations, which are checked.
Each instruction is decoded once into an `_Entry`; the run itself only touches ints.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from zpipe._base import PipeSchedule, Step, build_stages
from zpipe._errors import ScheduleError
from zpipe._gc import paused_gc
from zpipe._instructions import (
    BackwardInputPass,
    BackwardPass,
    BackwardWeightPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)

# What has happened to the activation a buffer holds (bit flags).
INPUT, LABELS, FORWARD, GRAD_IN, BWD_INPUT, BWD_WEIGHT, ACT_SENT, GRAD_SENT, DEAD = (
    1 << i for i in range(9)
)
# Instruction codes. Sends and receives are the codes from SEND_ACT up.
LOAD, FWD, BWD, BWD_I, BWD_W, STEP, TIED, OTHER, SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD = range(
    12
)
_CODES = {
    LoadMicroBatch: LOAD,
    ForwardPass: FWD,
    BackwardPass: BWD,
    BackwardInputPass: BWD_I,
    BackwardWeightPass: BWD_W,
    ReduceGrads: STEP,
    OptimizerStep: STEP,
    ReduceTiedGrads: TIED,
    SendActivation: SEND_ACT,
    SendGrad: SEND_GRAD,
    RecvActivation: RECV_ACT,
    RecvGrad: RECV_GRAD,
}
Message = tuple[int, int, int]  # (SEND_ACT or SEND_GRAD, micro-batch, sender's virtual stage)


class _Entry(NamedTuple):
    """One instruction, decoded: peer is the stage a message goes to or comes from (-1: none)."""

    code: int
    buffer: int
    virtual: int
    peer: int
    micro_batch: int | None
    step: int


@dataclass
class _Record:
    """The activation of one micro-batch at one virtual stage, held in a buffer."""

    micro_batch: int
    virtual: int
    done: int  # the flags after which nothing needs the activation any more
    flags: int = 0

    def describe(self) -> str:
        return f"micro-batch {self.micro_batch} (virtual stage {self.virtual})"


@dataclass
class ValidationReport:
    """What a validated schedule does, per stage."""

    steps: list[int]
    instructions: list[int]
    messages_sent: list[int]
    #: the most buffers holding a needed activation at once
    peak_buffers: list[int]
    num_pipe_buffers: list[int]


@dataclass
class _Stage:
    """One stage's program and the state of its buffers while it runs."""

    index: int
    schedule: PipeSchedule
    commands: list[PipeInstruction]
    program: list[_Entry]
    last_virtual: int
    training: bool
    pos: int = 0
    buffers: dict[int, _Record] = field(default_factory=dict)
    loaded_inputs: int = 0
    loaded_labels: int = 0
    forwarded: set[tuple[int, int]] = field(default_factory=set)
    completed: set[tuple[int, int]] = field(default_factory=set)
    local: deque[Message] = field(default_factory=deque)  # hand-offs between own chunks
    sent: int = 0
    live: int = 0
    peak: int = 0

    def fail(self, message: str) -> ScheduleError:
        pos = min(self.pos, len(self.program) - 1)
        return ScheduleError(
            message, stage=self.index, step=self.program[pos].step, instruction=self.commands[pos]
        )

    def mark(self, record: _Record, flags: int) -> None:
        """Record that `flags` happened; the activation dies once nothing more needs it."""
        record.flags |= flags
        if record.flags & record.done == record.done and not record.flags & DEAD:
            record.flags |= DEAD
            self.live -= 1
            self.completed.add((record.micro_batch, record.virtual))

    def claim(self, entry: _Entry, micro_batch: int) -> _Record:
        """The record a load or receive writes to; never one still needed by another batch."""
        record = self.buffers.get(entry.buffer)
        if record is not None and (record.micro_batch, record.virtual) == (
            micro_batch,
            entry.virtual,
        ):
            return record
        if record is not None and not record.flags & DEAD:
            raise self.fail(
                f"overwrites buffer {entry.buffer} with micro-batch {micro_batch} while it holds "
                f"{record.describe()}, still needed"
            )
        if self.training:  # needed until its weight gradient, and its input gradient sent
            done = BWD_WEIGHT | (GRAD_SENT if entry.virtual > 0 else 0)
        else:  # needed until its forward ran and its output was sent
            done = FORWARD | (ACT_SENT if entry.virtual < self.last_virtual else 0)
        record = _Record(micro_batch, entry.virtual, done)
        self.buffers[entry.buffer] = record
        self.live += 1
        self.peak = max(self.peak, self.live)
        return record

    def record(self, entry: _Entry, need: int, what: str) -> _Record:
        """The buffer's record, checked to belong to this chunk and to have `need` done."""
        record = self.buffers.get(entry.buffer)
        if record is None or record.virtual != entry.virtual:
            raise self.fail(
                f"comes before {what}: buffer {entry.buffer} holds no activation of virtual "
                f"stage {entry.virtual}"
            )
        if record.flags & need != need:
            raise self.fail(f"comes before {what} of {record.describe()}")
        if entry.micro_batch is not None and entry.micro_batch != record.micro_batch:
            raise self.fail(
                f"is annotated micro-batch {entry.micro_batch} but its buffer holds "
                f"{record.describe()}"
            )
        return record

    # What each instruction does to the buffers.

    def load(self, entry: _Entry) -> None:
        """Inputs on the first virtual stage, labels on the last, micro-batches in order."""
        first, last = entry.virtual == 0, entry.virtual == self.last_virtual
        if not (first or last):
            raise self.fail(f"loads on virtual stage {entry.virtual}, neither first nor last")
        micro_batch = self.loaded_inputs if first else self.loaded_labels
        self.loaded_inputs += first
        self.loaded_labels += last
        if micro_batch >= self.schedule.micro_batches:
            raise self.fail(f"loads micro-batch {micro_batch}, past the last")
        self.mark(self.claim(entry, micro_batch), (INPUT if first else 0) | (LABELS if last else 0))

    def forward(self, entry: _Entry) -> None:
        record = self.record(entry, INPUT, "the input")
        if record.flags & FORWARD:
            raise self.fail(f"repeats the forward of {record.describe()}")
        if entry.virtual == self.last_virtual and not record.flags & LABELS:
            raise self.fail(f"the last stage's forward of {record.describe()} has no labels")
        self.mark(record, FORWARD)
        self.forwarded.add((record.micro_batch, record.virtual))

    def backward(self, entry: _Entry) -> None:
        if entry.code == BWD_W:
            record = self.record(entry, BWD_INPUT, "the input-gradient pass")
            if record.flags & BWD_WEIGHT:
                raise self.fail(f"repeats the weight-gradient pass of {record.describe()}")
            self.mark(record, BWD_WEIGHT)
            return
        record = self.record(entry, FORWARD, "the forward")
        if entry.virtual < self.last_virtual and not record.flags & GRAD_IN:
            raise self.fail(f"comes before the output gradient (RecvGrad) of {record.describe()}")
        if record.flags & BWD_INPUT:
            raise self.fail(f"repeats the backward of {record.describe()}")
        self.mark(record, BWD_INPUT | (BWD_WEIGHT if entry.code == BWD else 0))

    def step_boundary(self) -> None:
        """Gradients are reduced and applied only once every backward of the batch is done."""
        if self.training and (missing := self.first_missing(self.completed)) is not None:
            raise self.fail(f"comes before the backward of {missing}")

    def first_missing(self, done: set[tuple[int, int]]) -> str | None:
        """The first (micro-batch, virtual stage) of this stage not in `done`, in words."""
        for chunk in range(self.schedule.chunks):
            virtual = self.schedule.virtual_stage(chunk)
            for micro_batch in range(self.schedule.micro_batches):
                if (micro_batch, virtual) not in done:
                    return f"micro-batch {micro_batch} on virtual stage {virtual}"
        return None

    def send(self, entry: _Entry) -> Message:
        """Check a send and return its message."""
        if entry.code == SEND_ACT:
            record = self.record(entry, FORWARD, "the forward")
            self.mark(record, ACT_SENT)
        else:
            record = self.record(entry, BWD_INPUT, "the backward")
            self.mark(record, GRAD_SENT)
        self.sent += 1
        return entry.code, record.micro_batch, record.virtual

    def receive(self, entry: _Entry, message: Message) -> None:
        code, micro_batch, sender_virtual = message
        kind = "activation" if code == SEND_ACT else "gradient"
        expected = "activation" if entry.code == RECV_ACT else "gradient"
        if kind != expected:
            raise self.fail(
                f"receives {_a(kind)} (micro-batch {micro_batch}) where it expects {_a(expected)}"
            )
        if entry.micro_batch is not None and entry.micro_batch != micro_batch:
            raise self.fail(
                f"is annotated micro-batch {entry.micro_batch} but receives micro-batch "
                f"{micro_batch}"
            )
        if code == SEND_ACT:
            if sender_virtual + 1 != entry.virtual:
                raise self.fail(
                    f"receives virtual stage {sender_virtual}'s output into virtual stage "
                    f"{entry.virtual}"
                )
            self.mark(self.claim(entry, micro_batch), INPUT)
            return
        record = self.record(entry, FORWARD, "the forward")
        if (record.micro_batch, sender_virtual) != (micro_batch, entry.virtual + 1):
            raise self.fail(
                f"receives the gradient of micro-batch {micro_batch} into a buffer holding "
                f"{record.describe()}"
            )
        self.mark(record, GRAD_IN)


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _decode(
    schedule: PipeSchedule, steps: list[Step], last: int
) -> tuple[list[PipeInstruction], list[_Entry]]:
    """A stage's instructions in order, and each as ints: what it is, its buffer, its virtual
    stage, its peer."""
    by_chunk = [schedule.virtual_stage(chunk) for chunk in range(schedule.chunks)]
    owners = [schedule.owner(v)[0] for v in range(last + 1)] + [-1]  # owners[-1]: no peer
    commands = [cmd for step in steps for cmd in step]
    # One comprehension per field: an instruction costs a few C-level calls, not a Python call.
    codes = [_CODES.get(type(cmd), OTHER) for cmd in commands]
    virtuals = [by_chunk[cmd.chunk_id] for cmd in commands]
    downstream = (SEND_ACT, RECV_GRAD)
    peers = [
        -1 if code < SEND_ACT else owners[min(v + 1 if code in downstream else v - 1, last + 1)]
        for code, v in zip(codes, virtuals, strict=True)
    ]
    buffers = [cmd.kwargs.get("buffer_id", -1) for cmd in commands]
    micro_batches = [cmd.micro_batch_id for cmd in commands]
    step_ids = [index for index, step in enumerate(steps) for _ in step]
    fields = zip(codes, buffers, virtuals, peers, micro_batches, step_ids, strict=True)
    new = tuple.__new__  # _Entry(...) would cost a Python-level call per instruction
    return commands, [new(_Entry, entry) for entry in fields]


def _build_stages(
    schedule_cls: type[PipeSchedule], micro_batches: int, stages: int, kwargs: dict[str, Any]
) -> list[_Stage]:
    schedules = build_stages(schedule_cls, micro_batches, stages, **kwargs)
    last = stages * schedules[0].chunks - 1
    decoded = [_decode(sched, list(sched), last) for sched in schedules]
    training = any(e.code in (BWD, BWD_I) for _, entries in decoded for e in entries)
    built = []
    for index, (schedule, (commands, entries)) in enumerate(zip(schedules, decoded, strict=True)):
        stage = _Stage(index, schedule, commands, entries, last, training)
        buffers = schedule.num_pipe_buffers()
        outside = [i for i, e in enumerate(entries) if not -1 <= e.buffer < buffers]
        if outside:
            stage.pos = outside[0]
            bad = entries[outside[0]].buffer
            raise stage.fail(f"buffer_id {bad} is outside num_pipe_buffers()={buffers}")
        built.append(stage)
    return built


def _advance(stage: _Stage, stages: list[_Stage]) -> bool:
    """Run a stage until it blocks; return whether it ran anything."""
    program, start, end = stage.program, stage.pos, len(stage.program)
    while stage.pos < end:
        entry = program[stage.pos]
        code = entry.code
        if code >= SEND_ACT:  # two instructions in three are sends and receives
            peer = entry.peer
            if peer == stage.index:  # a hand-off between own chunks: never blocks
                if code <= SEND_GRAD:
                    stage.local.append(stage.send(entry))
                elif stage.local:
                    stage.receive(entry, stage.local.popleft())
                else:
                    break
            elif peer < 0:
                side = "after the last" if code in (SEND_ACT, RECV_GRAD) else "before the first"
                raise stage.fail(f"has no peer: no virtual stage {side} one")
            elif not _rendezvous(stage, entry, stages[peer]):
                break
        elif code == FWD:
            stage.forward(entry)
        elif code <= BWD_W:  # a load or a backward
            if code != LOAD:
                stage.backward(entry)
            else:
                stage.load(entry)
        elif code == STEP:
            stage.step_boundary()
        elif code == TIED:
            break  # a collective of all stages: released by _run()
        stage.pos += 1
    return stage.pos != start


def _rendezvous(stage: _Stage, entry: _Entry, other: _Stage) -> bool:
    """Complete a send or receive with the peer's, if the peer is at the matching one."""
    if other.pos >= len(other.program):
        return False
    facing = other.program[other.pos]
    if facing.peer != stage.index or facing.code < SEND_ACT:
        return False
    sending = entry.code <= SEND_GRAD
    if (facing.code <= SEND_GRAD) == sending:
        return False
    if sending:
        other.receive(facing, stage.send(entry))
    else:
        stage.receive(entry, other.send(facing))
    other.pos += 1
    return True


def _diagnose(stages: list[_Stage]) -> ScheduleError:
    """Why no stage can move: an unmatched message, a missed collective, or a deadlock."""
    blocked = [s for s in stages if s.pos < len(s.program)]
    waits = []
    for stage in blocked:
        entry = stage.program[stage.pos]
        cmd = stage.commands[stage.pos]
        if entry.code == TIED:
            gone = [s.index for s in stages if s.pos >= len(s.program)]
            if gone:
                return stage.fail(f"is a collective that stages {gone} finished without reaching")
            waits.append(f"stage {stage.index} waits in ReduceTiedGrads for all stages")
            continue
        peer = stages[entry.peer]
        partner = "receive" if entry.code <= SEND_GRAD else "send"
        if peer is stage:
            return stage.fail("receives a hand-off from its own chunk that was never sent before")
        if peer.pos >= len(peer.program):
            return stage.fail(f"has no matching {partner}: stage {peer.index} has finished")
        facing = peer.program[peer.pos]
        if facing.peer == stage.index and (facing.code <= SEND_GRAD) == (entry.code <= SEND_GRAD):
            verb = "send to" if entry.code <= SEND_GRAD else "receive from"
            return stage.fail(
                f"deadlock: stages {stage.index} and {peer.index} both {verb} each other "
                f"(stage {peer.index} at step {facing.step} in {peer.commands[peer.pos]!r}); "
                "with blocking point-to-point neither returns"
            )
        waits.append(
            f"stage {stage.index} waits in {cmd!r} for stage {peer.index}, which is at step "
            f"{peer.program[peer.pos].step} in {peer.commands[peer.pos]!r}"
        )
    return blocked[0].fail("deadlock: " + "; ".join(waits))


def _check_complete(stage: _Stage) -> None:
    """Every micro-batch ran its forward (and backward, when training) on every chunk."""
    stage.pos = len(stage.program) - 1  # errors point at the last step
    if stage.local:
        raise stage.fail("sends a hand-off between its chunks that is never received")
    if (missing := stage.first_missing(stage.forwarded)) is not None:
        raise stage.fail(f"{missing} misses its forward")
    if stage.training and (missing := stage.first_missing(stage.completed)) is not None:
        raise stage.fail(f"{missing} misses its backward")


def _run(
    schedule_cls: type[PipeSchedule], micro_batches: int, stages: int, kwargs: dict[str, Any]
) -> list[_Stage]:
    """Build every stage, run them all together, and check what they did."""
    all_stages = _build_stages(schedule_cls, micro_batches, stages, kwargs)
    while True:
        progressed = False
        for stage in all_stages:
            progressed |= _advance(stage, all_stages)
        at_tied = [s.pos < len(s.program) and s.program[s.pos].code == TIED for s in all_stages]
        if all(at_tied):
            for stage in all_stages:
                stage.pos += 1
            progressed = True
        if not progressed:
            break
    if any(s.pos < len(s.program) for s in all_stages):
        raise _diagnose(all_stages)
    for stage in all_stages:
        _check_complete(stage)
    return all_stages


def validate(
    schedule_cls: type[PipeSchedule], micro_batches: int, stages: int, **kwargs: Any
) -> ValidationReport:
    """Build the schedule for every stage, run all of them together, and check it is safe.

    Raises ScheduleError, naming the stage, the step and the instruction, when a send has no
    matching receive (or one of the wrong kind), the stages deadlock under blocking
    point-to-point, a buffer is overwritten while its activation is still needed, a buffer id
    is outside `num_pipe_buffers()`, a backward (or a send, or the optimizer step) comes before
    what it needs, or a micro-batch misses its forward or backward on some stage.

    `kwargs` go to the schedule's constructor (e.g. `chunks=2`).
    """
    with paused_gc():
        all_stages = _run(schedule_cls, micro_batches, stages, kwargs)
    return ValidationReport(
        steps=[s.program[-1].step + 1 if s.program else 0 for s in all_stages],
        instructions=[len(s.program) for s in all_stages],
        messages_sent=[s.sent for s in all_stages],
        peak_buffers=[s.peak for s in all_stages],
        num_pipe_buffers=[s.schedule.num_pipe_buffers() for s in all_stages],
    )
