"""``deepspeed.runtime.checkpoint_engine``: DeepSpeed's interface for writing and reading one
checkpoint file, and its torch.save/torch.load engine. zengine's own checkpoints do not go
through it (``engine.save_checkpoint`` writes through torch.distributed.checkpoint); these are
for code written against DeepSpeed's engines (a ``PipelineModule``'s layer files, a script's
own files)."""

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine"]
