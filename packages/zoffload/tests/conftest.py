"""Shared helpers: storage bytes for bit-exact comparison, a fresh offloader per test."""

from __future__ import annotations

import subprocess
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


def swap_files(folder: Path) -> list[Path]:
    """The files under ``folder`` but the swap folders' markers ([Note: swap folders])."""
    return [f for f in folder.rglob("*") if f.is_file() and f.name != ".zoffload-owner"]


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


@pytest.fixture
def tiny_mount(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mounts a tmpfs of ``size`` bytes (``read_only=True``: mounted read-only) under
    ``tmp_path`` and returns it; unmounted after the test. Needs CAP_SYS_ADMIN (root here and
    on CI): the test is skipped, saying why, where mounting is not permitted."""
    mounted: list[Path] = []

    def mount(size: int, *, read_only: bool = False) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {done.stderr}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)
