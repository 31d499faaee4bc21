"""The instructions a pipeline schedule emits, with DeepSpeed's names, arguments and repr.

An engine dispatches on `type(instruction)` and calls its handler with `**instruction.kwargs`, as
DeepSpeed's PipelineEngine does. What DeepSpeed's instructions lack, the micro-batch and the model
chunk an instruction works on, rides on attributes outside `kwargs` so that dispatch is unchanged.
"""

from __future__ import annotations

from typing import Any, ClassVar


class PipeInstruction:
    """Base class of all instructions.

    Keyword arguments are kept in `kwargs` and also set as attributes (`cmd.buffer_id`).
    `micro_batch_id` and `chunk_id` are not part of `kwargs`: they say which micro-batch and which
    model chunk of this stage the instruction concerns (None when it concerns no micro-batch).
    """

    name: ClassVar[str] = "PipeInstruction"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = cls.__name__

    def __init__(
        self, *, micro_batch_id: int | None = None, chunk_id: int = 0, **kwargs: Any
    ) -> None:
        self.kwargs = kwargs
        self.micro_batch_id = micro_batch_id
        self.chunk_id = chunk_id
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        # DeepSpeed's form: the class name called with the keyword arguments.
        args = ", ".join(f"{key}={value!r}" for key, value in self.kwargs.items())
        return f"{self.name}({args})"

    def _key(self) -> tuple[Any, ...]:
        return (type(self), tuple(sorted(self.kwargs.items())), self.micro_batch_id, self.chunk_id)

    def __eq__(self, other: object) -> bool:
        # Value equality (DeepSpeed compares by identity), so step lists can be compared directly.
        if not isinstance(other, PipeInstruction):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


class OptimizerStep(PipeInstruction):
    """Step the optimizer, once the gradients of every micro-batch are reduced."""


class ReduceGrads(PipeInstruction):
    """Reduce the gradients across the data-parallel group of this stage."""


class ReduceTiedGrads(PipeInstruction):
    """All-reduce the gradients of weights tied across stages (embedding and head).

    A collective across the stages that hold the tied weight: every stage must reach it.
    """


class BufferOpInstruction(PipeInstruction):
    """An instruction that works on one pipeline buffer, `buffer_id`."""

    buffer_id: int

    def __init__(
        self,
        buffer_id: int,
        *,
        micro_batch_id: int | None = None,
        chunk_id: int = 0,
        **kwargs: Any,
    ) -> None:
        # Set directly rather than through PipeInstruction.__init__: schedules build
        # hundreds of thousands of these, and this is their hot path.
        self.kwargs = {"buffer_id": buffer_id, **kwargs} if kwargs else {"buffer_id": buffer_id}
        self.buffer_id = buffer_id
        self.micro_batch_id = micro_batch_id
        self.chunk_id = chunk_id
        if kwargs:
            for key, value in kwargs.items():
                setattr(self, key, value)


class LoadMicroBatch(BufferOpInstruction):
    """Load the next micro-batch into the buffer: inputs on the first stage, labels on the last."""


class ForwardPass(BufferOpInstruction):
    """Run this stage's (or chunk's) forward on the buffer's inputs; the last adds the loss."""


class BackwardPass(BufferOpInstruction):
    """Run the full backward of the buffer's forward: input gradients and weight gradients."""


class BackwardInputPass(BufferOpInstruction):
    """The first half of a split backward: the gradient of the inputs only.

    Zero-bubble schedules send this gradient upstream at once and defer the weight gradient.
    """


class BackwardWeightPass(BufferOpInstruction):
    """The second half of a split backward: the gradient of the weights, after BackwardInputPass."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's forward output to the stage that runs the next part of the model."""


class RecvActivation(BufferOpInstruction):
    """Receive the forward input of this stage (or chunk) into the buffer."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's inputs to the stage that produced them."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's forward output."""
