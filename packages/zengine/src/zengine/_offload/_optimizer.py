"""``offload_optimizer: {device: nvme}``: the fp32 masters and the optimizer state on NVMe.

Between steps the masters and every optimizer state tensor are written to files under
``nvme_path`` (one per tile of the step, [Note: tiled steps]) and their host memory is freed;
only the gradient partitions stay in memory, where backward adds to them. The first tile's read
starts when the backward of an accumulation boundary starts, so it runs while backward
computes; during the step each tile is read while the one before is stepped, and written in
the background after (zoffload's background I/O). The tensors stay the same objects, so the
torch optimizer, the ``safe_get_*`` functions and checkpoints see the same state.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import zoffload

log = logging.getLogger("zengine")

__all__ = ["NvmeStateSwapper"]


class NvmeStateSwapper:
    """Swaps the tensors the optimizer steps, and their state, out to NVMe and back in, one
    tile of the step at a time ([Note: tiled steps]; one tile by default)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        path: Path,
        *,
        pin_memory: bool,
        offloader: zoffload.Offloader | None = None,
        tiles: list[list[torch.Tensor]] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.path = path
        self.pin_memory = pin_memory
        self.offloader = offloader or zoffload.default_offloader()  # the config's `aio`, if any
        every = [t for group in optimizer.param_groups for t in group["params"]]
        self.tiles = tiles or [every]  # the stepped tensors, tile by tile
        # per tile, what is out (or coming back); None: in memory
        self._handles: list[zoffload.OffloadHandle | None] = [None] * len(self.tiles)
        # the first write that failed since the ranks last agreed ([Note: NVMe faults agreed]);
        # its tile stayed in memory, bit-exact
        self._failure: zoffload.OffloadError | None = None

    def _tensors(self, k: int) -> dict[str, torch.Tensor]:
        """Tile `k`'s masters and their state, by name (0-d state such as Adam's ``step``
        stays)."""
        found: dict[str, torch.Tensor] = {}
        for i, tensor in enumerate(self.tiles[k]):
            found[f"tile{k}.{i}"] = tensor
            for key, value in self.optimizer.state.get(tensor, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    found[f"tile{k}.{i}.{key}"] = value
        return found

    @property
    def swapped_out(self) -> bool:
        """Whether any tile is out (or on its way out or back)."""
        return any(h is not None for h in self._handles)

    def swap_out(self, k: int | None = None) -> None:
        """Write tile `k` (default: every tile) to NVMe in the background; its memory is
        freed once written."""
        for i in range(len(self.tiles)) if k is None else [k]:
            if self._handles[i] is None:
                try:
                    self._handles[i] = self.offloader.offload(
                        self._tensors(i),
                        zoffload.OffloadDeviceEnum.nvme,
                        pin_memory=self.pin_memory,
                        non_blocking=True,
                        nvme_path=self.path,
                        durable=False,  # scratch: no fsync ([Note: scratch files] in zoffload)
                    )
                except zoffload.OffloadError as error:
                    self._failed(error)

    def _failed(self, error: zoffload.OffloadError) -> None:
        """A write failed: its tile stays in memory (nothing was freed); the ranks raise it
        together at the next step (`take_failure`), not this rank alone mid-step."""
        if self._failure is None:
            log.warning("zengine: offload_optimizer to NVMe: %s; kept in memory", error)
            self._failure = error

    def _settle(self, k: int) -> None:
        """Wait for tile `k`'s write if one is in flight, noting a failure."""
        handle = self._handles[k]
        if handle is not None and handle.state == "offloading":
            try:
                handle.wait()
            except zoffload.OffloadError as error:
                self._handles[k] = None  # its bytes never left
                self._failed(error)

    def take_failure(self) -> zoffload.OffloadError | None:
        """The write failure noted since the last call (writes still in flight are waited
        for first), and forget it."""
        for k in range(len(self._handles)):
            self._settle(k)
        failure, self._failure = self._failure, None
        return failure

    def prefetch(self, k: int = 0) -> None:
        """Start reading tile `k` back (a no-op when it is in memory or on its way, or when
        there is no such tile)."""
        if k >= len(self._handles):
            return
        self._settle(k)
        handle = self._handles[k]
        if handle is not None and handle.state == "offloaded":
            handle.reload(non_blocking=True)

    def swap_in(self, k: int | None = None) -> None:
        """Tile `k` (default: every tile) in memory, when this returns."""
        tiles = range(len(self.tiles)) if k is None else [k]
        for i in tiles:
            self.prefetch(i)
        for i in tiles:
            handle = self._handles[i]
            if handle is not None:
                handle.wait()
                self._handles[i] = None

    def written(self, k: int) -> None:
        """Wait until tile `k`'s write is done and its memory freed (no-op for k < 0)."""
        if 0 <= k < len(self._handles):
            self._settle(k)

    def wait(self) -> None:
        """Wait for the transfers in flight (a write after the step: its memory is free)."""
        for k, handle in enumerate(self._handles):
            self._settle(k)
            if handle is not None and self._handles[k] is not None:
                handle.wait()
