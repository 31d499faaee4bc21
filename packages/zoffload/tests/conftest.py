"""Shared helpers: storage bytes for bit-exact comparison, a fresh offloader per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import zoffload


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of ``t``'s storage (views, padding and all), on the host."""
    s = t.untyped_storage()
    view = torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))
    return view.cpu().clone()


@pytest.fixture(name="storage_bytes")
def storage_bytes_fixture() -> Callable[[torch.Tensor], torch.Tensor]:
    return storage_bytes


@pytest.fixture
def offloader(tmp_path: Path) -> Iterator[zoffload.Offloader]:
    off = zoffload.Offloader(
        pool=zoffload.HostPool(), nvme_path=tmp_path / "nvme", chunk_bytes=64 << 10
    )
    yield off
    off.close()
    off.pool.close()
