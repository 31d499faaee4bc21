"""`PipelineError`: what the pipeline engine raises, naming the stage and the instruction."""

from __future__ import annotations

import zpipe

__all__ = ["PipelineError", "describe"]


def describe(cmd: zpipe.PipeInstruction) -> str:
    """An instruction as the error messages show it: its repr, and its micro-batch and chunk
    when it has them (``RecvGrad(buffer_id=1) of micro-batch 3``)."""
    text = repr(cmd)
    mb = getattr(cmd, "micro_batch_id", None)
    if mb is not None:
        text += f" of micro-batch {mb}"
    chunk = getattr(cmd, "chunk_id", 0)
    if chunk:
        text += f", chunk {chunk}"
    return text


class PipelineError(RuntimeError):
    """A pipeline stage failed, or the stages disagree.

    ``stage`` is the stage the message is about (None when it concerns no single stage);
    ``instruction`` the schedule instruction that was running, as text.
    """

    def __init__(self, message: str, *, stage: int | None = None, instruction: str = "") -> None:
        super().__init__(message)
        self.stage = stage
        self.instruction = instruction
