"""DeepSpeed's schedules, step for step: InferenceSchedule, TrainSchedule, DataParallelSchedule.

The step lists and buffer ids equal DeepSpeed's (tests compare them with golden lists produced by
DeepSpeed 0.19 itself). Their steps are lock-step: a barrier between two steps cannot deadlock,
because even and odd stages order their sends and receives oppositely.
"""

from __future__ import annotations

from collections.abc import Iterator

from zpipe._base import PipeSchedule, Step
from zpipe._instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)


class InferenceSchedule(PipeSchedule):
    """Forward passes only, pipelined over two alternating buffers."""

    def steps(self) -> Iterator[Step]:
        """Yield `micro_batches + stages - 1` steps."""
        even_stage = self.stage_id % 2 == 0
        for step_id in range(self.micro_batches + self.stages - 1):
            micro_batch = step_id - self.stage_id
            # Buffers alternate, and adjacent stages use them in opposite phase.
            recv_buf = step_id % 2 if even_stage else (step_id + 1) % 2
            send_buf = (step_id + 1) % 2 if even_stage else step_id % 2
            receives = self._valid_stage(self.prev_stage) and self._valid_micro_batch(micro_batch)
            sends = self._valid_stage(self.next_stage) and self._valid_micro_batch(micro_batch - 1)

            cmds: Step = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(micro_batch):
                cmds.append(LoadMicroBatch(recv_buf, micro_batch_id=micro_batch))
            recv = RecvActivation(recv_buf, micro_batch_id=micro_batch) if receives else None
            send = SendActivation(send_buf, micro_batch_id=micro_batch - 1) if sends else None
            # Even stages send first and odd stages receive first, so blocking p2p pairs up.
            order = (send, recv) if even_stage else (recv, send)
            cmds.extend(cmd for cmd in order if cmd is not None)
            if self._valid_micro_batch(micro_batch):
                cmds.append(ForwardPass(recv_buf, micro_batch_id=micro_batch))
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Two buffers: one being received into while the other is sent from."""
        return 2


class TrainSchedule(PipeSchedule):
    """Synchronous 1F1B (PipeDream-Flush): forwards and backwards alternate in steady state.

    Steps alternate between forward and backward; a stage's sends are deferred by one step so
    that each step's communication pairs with the neighbour's in lock-step.
    """

    def steps(self) -> Iterator[Step]:
        """Yield `2 * (micro_batches + stages - 1)` steps."""
        prev_micro_batch = -1
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        for step_id in range(total_steps):
            micro_batch, is_forward = self._step_to_micro_batch(step_id)
            prev_valid = self._valid_micro_batch(prev_micro_batch)
            curr_valid = self._valid_micro_batch(micro_batch)
            prev_buffer = self._buffer_idx(prev_micro_batch) if prev_valid else -1
            curr_buffer = self._buffer_idx(micro_batch) if curr_valid else -1

            cmds: Step = []
            if is_forward:
                if prev_valid and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(prev_buffer, micro_batch_id=prev_micro_batch))
                if curr_valid and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(curr_buffer, micro_batch_id=micro_batch))
            else:
                if curr_valid and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(curr_buffer, micro_batch_id=micro_batch))
                if prev_valid and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(prev_buffer, micro_batch_id=prev_micro_batch))

            if (self.is_first_stage or self.is_last_stage) and is_forward and curr_valid:
                cmds.append(LoadMicroBatch(curr_buffer, micro_batch_id=micro_batch))
            if curr_valid:
                compute = ForwardPass if is_forward else BackwardPass
                cmds.append(compute(curr_buffer, micro_batch_id=micro_batch))
            if step_id == total_steps - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_micro_batch = micro_batch
            yield cmds

    def num_pipe_buffers(self) -> int:
        """At most `stages - stage_id` micro-batches are in flight on a stage (at least 2)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """The micro-batch a step works on, and whether the step is a forward.

        Even stages run forwards on even steps, odd stages on odd steps; the other steps are
        backwards, which reach stage s `stages - s` micro-batches behind the forwards.
        """
        even_step, even_stage = step_id % 2 == 0, self.stage_id % 2 == 0
        base = step_id // 2
        if even_step == even_stage:
            return base - self.stage_id // 2, True
        if even_step:
            return base - self.stages + (self.stage_id + 1) // 2, False
        return base - self.stages + 1 + self.stage_id // 2, False


class DataParallelSchedule(PipeSchedule):
    """Plain data parallelism on one stage: load, forward, backward per micro-batch."""

    def steps(self) -> Iterator[Step]:
        """Yield one step per micro-batch; the last reduces the gradients and steps."""
        for micro_batch in range(self.micro_batches):
            cmds: Step = [
                LoadMicroBatch(buffer_id=0, micro_batch_id=micro_batch),
                ForwardPass(buffer_id=0, micro_batch_id=micro_batch),
                BackwardPass(buffer_id=0, micro_batch_id=micro_batch),
            ]
            if micro_batch == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        """One buffer."""
        return 1
