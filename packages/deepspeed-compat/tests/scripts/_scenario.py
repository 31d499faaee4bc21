"""What the torchrun scripts share: Accelerate's DeepSpeed state on a CPU machine, the data,
and writing rank 0's findings."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

VOCAB = 128


def use_deepspeed_state(enabled: bool) -> None:
    """Make Accelerate's process state afresh, for DeepSpeed or not.

    Accelerate picks DeepSpeed only on a machine with an accelerator unless the process group's
    backend is named: without one it counts each rank as a world of one. On CPU the state is
    made here, naming gloo, and Transformers is told to use it (``use_configured_state``)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    if enabled:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    else:
        PartialState(cpu=True, backend="gloo")


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the same on every rank; labels are the inputs (causal LM)."""

    def __init__(self, samples: int = 64, length: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def write_result(result: dict[str, Any]) -> None:
    """Rank 0's findings, as JSON, where the test reads them."""
    if int(os.environ.get("RANK", "0")) == 0:
        Path(os.environ["ZSTACK_RESULT"]).write_text(json.dumps(result, indent=1))
