"""Accelerate's process state on a machine without an accelerator, told the backend DeepSpeed's
process group runs on, so that it counts the group's ranks.

[Note: Accelerate's world on CPU]
Accelerate's ``PartialState`` (1.15, ``accelerate/state.py``) picks its backend from the
accelerators it finds: NCCL for CUDA, and so on. With DeepSpeed asked for
(``ACCELERATE_USE_DEEPSPEED``, which Transformers' ``TrainingArguments(deepspeed=...)`` and
``accelerate launch --use_deepspeed`` set) it calls ``deepspeed.comm.init_distributed(
dist_backend=self.backend, ...)``, and then reads its own backend again: on a CPU-only machine
it found none, so the backend is still None and it counts a world of one, although the process
group it just had started holds every rank. Each rank then fills ``train_batch_size`` for
itself alone and reads all the data, and the engine's batch check fails
(``train_batch_size 2 != ... * world size 2 = 4``). Naming the backend
(``PartialState(backend="gloo")`` before the Trainer or Accelerator) is the way out Accelerate
offers; real DeepSpeed meets the same on CPU.

zstack's ``init_distributed``, called with no backend while a ``PartialState`` for DeepSpeed is
being made, writes the backend of the group it started into that state (Accelerate's states
share one ``_shared_state`` dict), where Accelerate reads it next: from there on it is the state
``PartialState(backend="gloo")`` makes. Only such a state is touched: one whose backend is None
and that has not yet counted its processes, with DeepSpeed asked for and the CPU not forced.
When Accelerate changes this path, the compat tests that run the Trainer and Accelerate as
written under torchrun (test_cpu_as_written.py) fail, and the engine's batch-size error names
the two lines a user adds instead (zengine's ``_config/_batch.py``).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

__all__ = ["tell_accelerate_the_backend"]


def tell_accelerate_the_backend(asked: str | None) -> None:
    """After ``init_distributed(dist_backend=asked)``: if Accelerate is making its process state
    for DeepSpeed without a backend, give it the process group's ([Note: Accelerate's world on
    CPU])."""
    if asked is not None or not dist.is_initialized():
        return
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return
    state = sys.modules.get("accelerate.state")
    partial = getattr(state, "PartialState", None)
    shared = getattr(partial, "_shared_state", None)
    if not isinstance(shared, dict):
        return
    being_made = "backend" in shared and "num_processes" not in shared
    if being_made and shared["backend"] is None and shared.get("_cpu") is False:
        shared["backend"] = str(dist.get_backend())
