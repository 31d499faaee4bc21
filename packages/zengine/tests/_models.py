"""A small GPT for the engine's tests, and the single-process PyTorch run to compare with."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, HIDDEN, SEQ = 32, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyGPT(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


def global_batches(steps: int, batch: int, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(steps)]


def plain_losses(
    model: nn.Module, data: list[torch.Tensor], *, lr: float, clip: float = 0.0
) -> list[float]:
    """What DeepSpeed's "Adam" does (AdamW, weight decay 0.01 here), in one process."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for tokens in data:
        loss = model(tokens)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# uneven: partitions and shards straddle parameters, padding on the last rank
SCALE_SIZES = (7, 5, 3)


class Scale(nn.Module):
    """loss = sum(p * x) over its parameters (of `SCALE_SIZES`, zeros): each parameter's
    gradient is its slice of x, whatever the parameters are."""

    def __init__(self) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in SCALE_SIZES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = x.split(list(SCALE_SIZES))
        return sum((p * piece).sum() for p, piece in zip(self.params, pieces, strict=True))
