"""``offload_optimizer: {device: nvme}``: the fp32 masters and the optimizer state on NVMe.

Between steps the masters and every optimizer state tensor are written to a file under
``nvme_path`` and their host memory is freed; only the gradient partitions stay in memory, where
backward adds to them. The read starts when the backward of an accumulation boundary starts, so
it runs while backward computes, and the step waits for it; the write after the step runs while
the next forward computes (zoffload's background I/O). The tensors stay the same objects, so
the torch optimizer, the ``safe_get_*`` functions and checkpoints see the same state.
"""

from __future__ import annotations

from pathlib import Path

import torch

import zoffload

__all__ = ["NvmeStateSwapper"]


class NvmeStateSwapper:
    """Swaps the tensors the optimizer steps, and their state, out to NVMe and back in."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        path: Path,
        *,
        pin_memory: bool,
        offloader: zoffload.Offloader | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.path = path
        self.pin_memory = pin_memory
        self.offloader = offloader or zoffload.default_offloader()  # the config's `aio`, if any
        self._handle: zoffload.OffloadHandle | None = None  # what is out (or coming back)
        path.mkdir(parents=True, exist_ok=True)

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The masters and their state, by name (0-d state such as Adam's ``step`` stays)."""
        found: dict[str, torch.Tensor] = {}
        for g, group in enumerate(self.optimizer.param_groups):
            for i, tensor in enumerate(group["params"]):
                found[f"group{g}.param{i}"] = tensor
                for key, value in self.optimizer.state.get(tensor, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        found[f"group{g}.param{i}.{key}"] = value
        return found

    @property
    def swapped_out(self) -> bool:
        return self._handle is not None

    def swap_out(self) -> None:
        """Write the state to NVMe in the background; its memory is freed once written."""
        if self._handle is not None:
            return
        self._handle = self.offloader.offload(
            self._tensors(),
            zoffload.OffloadDeviceEnum.nvme,
            pin_memory=self.pin_memory,
            non_blocking=True,
            nvme_path=self.path,
        )

    def prefetch(self) -> None:
        """Start reading the state back (a no-op when it is in memory or on its way)."""
        handle = self._handle
        if handle is not None and handle.state in ("offloading", "offloaded"):
            handle.reload(non_blocking=True)

    def swap_in(self) -> None:
        """The state in memory, when this returns."""
        handle = self._handle
        if handle is None:
            return
        self.prefetch()
        handle.wait()
        self._handle = None
