"""The model, data and configs of the DeepSpeed fixture checkpoints, shared by the script that
writes them with the real DeepSpeed (`deepspeed_checkpoints/make.py`) and by zstack's tests
that load them. Torch only: neither side's engine is imported here.

The model has what a checkpoint reader must place: a tied embedding and head (DeepSpeed's
``shared_params``), a frozen layer (``frozen_param_shapes`` / ``frozen_param_fragments``), a
persistent buffer and a non-persistent one, parameters whose sizes do not divide by 2 or 4
(ZeRO-3 padding), and two optimizer parameter groups (the norm's weights without decay).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

FIXTURES = Path(__file__).resolve().parent / "deepspeed_checkpoints" / "fixtures"
VOCAB, HIDDEN, SEQ = 13, 6, 5
GLOBAL_BATCH = 8  # the same at every world size: the losses compare across them
STEPS_BEFORE, STEPS_AFTER = 3, 3
SEED, DATA_SEED = 0, 7
LR = 2e-2


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.down = nn.Linear(3 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("position", torch.arange(SEQ, dtype=torch.float32) / SEQ)
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        position = self.get_buffer("position").to(self.embed.weight.dtype)
        x = self.embed(tokens) + position[:, None]
        x = x + self.frozen(x)
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


def model() -> Model:
    torch.manual_seed(SEED)
    return Model()


def param_groups(m: nn.Module) -> list[dict[str, Any]]:
    """Two groups: the norm without weight decay, the other trainable parameters with it."""
    norm = [p for n, p in m.named_parameters() if n.startswith("norm.")]
    rest = [p for n, p in m.named_parameters() if p.requires_grad and not n.startswith("norm.")]
    return [{"params": rest}, {"params": norm, "weight_decay": 0.0}]


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(steps)]


def local(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return tokens.view(world, -1, SEQ)[rank]


# name -> (zero stage, precision, world size, extra zero_optimization keys)
CASES: dict[str, tuple[int, str, int, dict[str, Any]]] = {
    "stage0_fp32_ws2": (0, "fp32", 2, {}),
    "stage0_bf16_ws2": (0, "bf16", 2, {}),
    "stage0_fp16_ws2": (0, "fp16", 2, {}),
    "stage1_fp32_ws2": (1, "fp32", 2, {}),
    "stage1_bf16_ws2": (1, "bf16", 2, {}),
    "stage2_fp32_ws2": (2, "fp32", 2, {}),
    "stage2_fp16_ws2": (2, "fp16", 2, {}),
    "stage2_fp32_ws4": (2, "fp32", 4, {}),
    "stage2_offload_ws2": (2, "fp32", 2, {"offload_optimizer": {"device": "cpu"}}),
    "stage3_fp32_ws2": (3, "fp32", 2, {}),
    "stage3_bf16_ws2": (3, "bf16", 2, {}),
    "stage3_fp16_ws2": (3, "fp16", 2, {}),
    "stage3_fp32_ws4": (3, "fp32", 4, {}),
    "stage3_subgroups_ws2": (3, "fp32", 2, {"sub_group_size": 40}),
    "stage3_offload_ws2": (3, "fp32", 2, {"offload_optimizer": {"device": "cpu"}}),
}


def config(case: str, world: int | None = None) -> dict[str, Any]:
    """`case`'s config, at its own world size or at `world` (the same global batch)."""
    stage, precision, case_world, extra = CASES[case]
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world or case_world),
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_max_lr": LR, "warmup_min_lr": 0.0},
        },
        "zero_optimization": {"stage": stage, **extra},
    }
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


# -- the pipeline: DeepSpeed's PipelineModule and zstack's take the same specs --------------------

PIPE_BASE_SEED = 1234
# name -> (ZeRO stage, pipeline stages, data-parallel ranks)
PIPE_CASES: dict[str, tuple[int, int, int]] = {
    "pipe_stage1_pp2_dp2": (1, 2, 2),
    "pipe_stage0_pp2_dp1": (0, 2, 1),
}


class PipeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.down = nn.Linear(3 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def pipe_head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.get_parameter("weight").t()


def pipe_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def pipe_specs(layer_spec: Any, tied_layer_spec: Any) -> list[Any]:
    """The layers, as either library's spec classes: a tied embedding, two blocks, a norm
    with a running buffer, the tied head."""
    return [
        tied_layer_spec("embed", nn.Embedding, VOCAB, HIDDEN),
        layer_spec(PipeBlock),
        layer_spec(PipeBlock),
        layer_spec(nn.BatchNorm1d, SEQ),
        tied_layer_spec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=pipe_head),
    ]


def pipe_config(case: str, data_parallel: int | None = None) -> dict[str, Any]:
    stage, _, dp = PIPE_CASES[case]
    micro = 2
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GLOBAL_BATCH // (micro * (data_parallel or dp)),
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }


def pipe_micro_batches(
    tokens: torch.Tensor, accumulation: int, data_parallel: int, rank: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Data-parallel rank `rank`'s micro-batches of one global batch (tokens, labels)."""
    pieces = tokens.view(accumulation, data_parallel, -1, SEQ)
    return [(pieces[k, rank], pieces[k, rank].roll(1, dims=1)) for k in range(accumulation)]


def losses(case: str) -> dict[str, Any]:
    """What DeepSpeed recorded for `case`: its losses before the save and continuing after."""
    result: dict[str, Any] = json.loads((FIXTURES / case / "losses.json").read_text())
    return result
