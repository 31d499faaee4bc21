"""``deepspeed.ops.aio``: the async I/O builder (see `deepspeed.ops.op_builder`)."""

from deepspeed.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
