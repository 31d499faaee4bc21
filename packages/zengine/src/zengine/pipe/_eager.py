"""`EagerSends`: a schedule whose sends go right after the computation that makes their data.

DeepSpeed's TrainSchedule and InferenceSchedule send a forward's activation one step late
(after the next step's receive, so that blocking sends pair up in lock-step), and the stage
downstream waits that long for it. The engine's sends never block, so each activation and each
input gradient can leave as soon as it is computed. The move is made only when every peer then
gets the same messages in the same order as before: the receiving side and the FIFO channel
between two ranks see no difference, and a send that never blocks cannot make anyone wait, so
the schedule stays deadlock-free. Otherwise (a schedule that sends in another order than it
computes) the steps are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterator

import zpipe

__all__ = ["EagerSends"]

_PRODUCERS: dict[type[zpipe.PipeInstruction], tuple[type[zpipe.PipeInstruction], ...]] = {
    zpipe.SendActivation: (zpipe.ForwardPass,),
    zpipe.SendGrad: (zpipe.BackwardPass, zpipe.BackwardInputPass),
}
Step = list[zpipe.PipeInstruction]


def _key(cmd: zpipe.PipeInstruction) -> tuple[str, int | None, int]:
    """Which computation's data a send carries, or which data a computation makes."""
    kind = "F" if isinstance(cmd, zpipe.ForwardPass | zpipe.SendActivation) else "B"
    return kind, cmd.micro_batch_id, cmd.chunk_id


class EagerSends(zpipe.PipeSchedule):
    """`base`'s schedule (built with `kwargs`) with its sends moved up (see the module doc)."""

    def __init__(
        self,
        micro_batches: int,
        stages: int,
        stage_id: int,
        *,
        base: type[zpipe.PipeSchedule],
        **kwargs: int,  # the schedule's own (chunks)
    ) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.base = base(micro_batches=micro_batches, stages=stages, stage_id=stage_id, **kwargs)
        self.chunks = self.base.chunks
        original = [list(step) for step in self.base]
        moved = self._moved(original)
        self.moved = moved is not None  # whether any send was moved
        self._steps = moved if moved is not None else original

    def steps(self) -> Iterator[Step]:
        for step in self._steps:
            yield list(step)

    def num_pipe_buffers(self) -> int:
        return self.base.num_pipe_buffers()

    def virtual_stage(self, chunk_id: int) -> int:
        return self.base.virtual_stage(chunk_id)

    def owner(self, virtual_stage: int) -> tuple[int, int]:
        return self.base.owner(virtual_stage)

    def _peer(self, cmd: zpipe.PipeInstruction) -> int:
        virtual = self.virtual_stage(cmd.chunk_id)
        step = 1 if isinstance(cmd, zpipe.SendActivation) else -1
        return self.owner(virtual + step)[0]

    def _moved(self, steps: list[Step]) -> list[Step] | None:
        """The steps with each send right after its computation, or None when that would
        change what a peer receives, or in which order, or moves nothing."""
        made: set[tuple[str, int | None, int]] = set()
        movable: dict[tuple[str, int | None, int], zpipe.PipeInstruction] = {}
        for cmd in (c for step in steps for c in step):
            if type(cmd) in _PRODUCERS and cmd.micro_batch_id is not None and _key(cmd) in made:
                movable[_key(cmd)] = cmd
            elif isinstance(cmd, zpipe.ForwardPass | zpipe.BackwardPass | zpipe.BackwardInputPass):
                made.add(_key(cmd))
        result: list[Step] = []
        for step in steps:
            new: Step = []
            for cmd in step:
                if type(cmd) in _PRODUCERS and movable.get(_key(cmd)) is cmd:
                    continue  # already sent after its computation
                new.append(cmd)
                found = movable.get(_key(cmd))
                if found is not None and type(cmd) in _PRODUCERS[type(found)]:
                    new.append(found)
            result.append(new)
        if result == steps or self._sent(result) != self._sent(steps):
            return None
        return result

    def _sent(self, steps: list[Step]) -> dict[int, list[tuple[str, int | None, int]]]:
        """Per peer stage, the messages this stage sends it, in order."""
        out: dict[int, list[tuple[str, int | None, int]]] = {}
        for cmd in (c for step in steps for c in step):
            if type(cmd) in _PRODUCERS:
                out.setdefault(self._peer(cmd), []).append(_key(cmd))
        return out
