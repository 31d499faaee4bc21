"""DeepSpeed's test helpers from its ``tests/unit/simple_model.py`` (`SimpleModel`,
`random_dataset`, `random_dataloader`), with the same behaviour, for tests written against
DeepSpeed: ``from zengine.testing import SimpleModel`` stands in for
``from unit.simple_model import SimpleModel``."""

from __future__ import annotations

from typing import Any

import torch

from zcomm.testing import preferred_dtype

__all__ = ["SimpleModel", "random_dataloader", "random_dataset"]


class SimpleModel(torch.nn.Module):
    """``nlayers`` square Linear layers and a cross-entropy loss; with several layers each
    layer's output adds the output of layer i // 2 (so a layer runs twice in one forward)."""

    def __init__(self, hidden_dim: int, empty_grad: bool = False, nlayers: int = 1) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(
            [torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)]
        )
        if empty_grad:
            self.layers2 = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()
        self.empty_grad = empty_grad

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        loss: torch.Tensor = self.cross_entropy_loss(x, y)
        return loss


def random_dataset(
    total_samples: int, hidden_dim: int, device: Any, dtype: torch.dtype | None = None
) -> torch.utils.data.TensorDataset:
    dtype = dtype or preferred_dtype()
    data = torch.randn(total_samples, hidden_dim, device=device, dtype=dtype)
    label = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    return torch.utils.data.TensorDataset(data, label)


def random_dataloader(
    model: Any, total_samples: int, hidden_dim: int, device: Any, dtype: torch.dtype | None = None
) -> torch.utils.data.DataLoader[Any]:
    batch_size = model.train_micro_batch_size_per_gpu()
    dataset = random_dataset(total_samples, hidden_dim, device, dtype=dtype)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)
