"""NVMe faults at 2 ranks, agreed ([Note: NVMe faults agreed]): a full disk, a read-only one, a
write that fails midway and a filesystem two ranks share raise the same named error on every
rank, with the state where it was, bit-exact, and no swap file left; at initialize before the
model is partitioned; with ZeRO-Infinity's swap files at the step after the write failed. The
disks are real tmpfs mounts (root; skipped, saying why, where mounting is not permitted) and
a real file size limit; rank 1 is the one that fails unless both share the filesystem."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zcomm
import zengine
import zoffload
import zpartition
from zcomm.testing import DistributedTest
from zengine._offload._states import state_tensors
from zoffload import OffloadStateTypeEnum

from ._helpers import file_size_limit

WIDTH = 256  # 4 layers: about 1 MiB of fp32 parameters, half of it per rank at stage 3


def _mount_works() -> str | None:
    """Why a tmpfs cannot be mounted here (None: it can)."""
    with tempfile.TemporaryDirectory() as where:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", where],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return done.stderr.strip() or f"mount exited {done.returncode}"
        subprocess.run(["umount", where], check=True)
    return None


_CANNOT_MOUNT = _mount_works()
pytestmark = pytest.mark.skipif(
    _CANNOT_MOUNT is not None,
    reason=f"needs to mount a tmpfs (root / CAP_SYS_ADMIN): {_CANNOT_MOUNT}",
)


class _Mounts:
    """tmpfs mounts made by this rank, unmounted at the end."""

    def __init__(self) -> None:
        self.made: list[Path] = []

    def __call__(self, size: int, *, read_only: bool = False) -> Path:
        where = Path(tempfile.mkdtemp(prefix=f"zengine-nvme-fault-{zcomm.get_rank()}-"))
        options = f"size={size}" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
        self.made.append(where)
        return where

    def close(self) -> None:
        for where in self.made:
            subprocess.run(["umount", "-l", str(where)], check=False)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))


def _config(stage: int, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


def _step(engine: zengine.Engine, data: Iterator[torch.Tensor]) -> None:
    engine.backward(engine(next(data)).square().mean())
    engine.step()


def _data() -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(5 + zcomm.get_rank())
    while True:
        yield torch.randn(4, WIDTH, generator=g)


def _snapshot(engine: zengine.Engine) -> dict[str, torch.Tensor]:
    return {
        f"{s.value}.{k}": t.clone()
        for s in OffloadStateTypeEnum
        for k, t in state_tensors(engine, s).items()
    }


def _swap_files(folder: Path) -> list[Path]:
    return [f for f in folder.rglob("*") if f.is_file() and f.name != zoffload._swapdir.MARKER]


class TestOffloadNvmeFaults(DistributedTest):
    world_size = 2

    def test_offload_states_agrees_on_every_fault(self) -> None:
        rank = zcomm.get_rank()
        mounts = _Mounts()
        try:
            engine, *_ = zengine.initialize(model=_model(), config=_config(3))
            data = _data()
            _step(engine, data)
            before = _snapshot(engine)
            held = engine.memory_held()
            fine = Path(tempfile.mkdtemp(prefix=f"zengine-nvme-ok-{rank}-"))
            full = mounts(64 << 10) if rank == 1 else fine
            read_only = mounts(1 << 20, read_only=True) if rank == 1 else fine
            # one filesystem for both ranks: room for one rank's states, not for two
            shared = mounts(3 << 20) if rank == 0 else None
            listed: list[Any] = [None] * 2
            zcomm.all_gather_object(listed, str(shared))  # torch's needs NumPy
            shared = Path(listed[0])
            cases: list[tuple[Path, type[zoffload.NvmeError], str, Any]] = [
                (full, zoffload.NvmeSpaceError, "rank 1 .*not enough free space", None),
                (read_only, zoffload.NvmeError, "rank 1 .*read-only", None),
                # a write that fails midway on rank 1 (the space check passes)
                (fine, zoffload.NvmeError, "rank 1 .*File too large", 256 << 10),
                (shared, zoffload.NvmeSpaceError, r"ranks \[0, 1\] write \d+ bytes", None),
            ]
            for path, kind, match, limit in cases:
                limited = limit is not None and rank == 1
                guard = file_size_limit(limit) if limited else contextlib.nullcontext()
                with guard, pytest.raises(kind, match=match) as info:
                    engine.offload_states(device="nvme", nvme_path=path)
                messages: list[Any] = [None] * 2
                zcomm.all_gather_object(messages, str(info.value))  # torch's needs NumPy
                assert messages[0] == messages[1]  # the same error on every rank
                after = _snapshot(engine)
                assert after.keys() == before.keys()
                for key, tensor in before.items():
                    assert torch.equal(after[key], tensor), key  # never moved
                assert engine.memory_held() == held
                assert not engine._offloaded.handles
                assert not _swap_files(path)  # no partial file, no file left
            # and with room everywhere the same engine offloads and trains on
            engine.offload_states(device="nvme", nvme_path=fine)
            engine.reload_states()
            _step(engine, data)
            assert not _swap_files(fine)
        finally:
            torch.distributed.barrier()
            mounts.close()

    def test_initialize_checks_the_path_before_partitioning(self) -> None:
        rank = zcomm.get_rank()
        mounts = _Mounts()
        try:
            fine = Path(tempfile.mkdtemp(prefix=f"zengine-nvme-ok-{rank}-"))
            a_file = fine / "a-file"
            a_file.write_text("x")
            cases = [
                ("offload_optimizer", mounts(1 << 20, read_only=True), "read-only"),
                ("offload_param", mounts(64 << 10), "not enough free space"),
                ("offload_optimizer", a_file, "not a directory"),
            ]
            for section, bad, problem in cases:
                path = bad if rank == 1 else fine / section
                model = _model()
                zero = {section: {"device": "nvme", "nvme_path": str(path)}}
                with pytest.raises(zoffload.NvmeError, match=f"initialize.*rank 1 .*{problem}"):
                    zengine.initialize(model=model, config=_config(3, **zero))
                assert not any(zpartition.is_zero_param(p) for p in model.parameters())
        finally:
            torch.distributed.barrier()
            mounts.close()

    def test_zero_infinity_swap_write_failure_is_raised_at_the_next_step(self) -> None:
        rank = zcomm.get_rank()
        mounts = _Mounts()
        try:
            # room for the fp32 masters (512 KiB a rank), not for Adam's state beside them
            path = mounts(800 << 10) if rank == 1 else Path(tempfile.mkdtemp())
            zero = {"offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}
            engine, *_ = zengine.initialize(model=_model(), config=_config(3, **zero))
            data = _data()
            _step(engine, data)  # its write fails on rank 1: the state stays in memory there
            optimizer = engine.optimizer.resident()
            masters = [t.clone() for t in optimizer.stepped_tensors()]
            state = [v.clone() for per in optimizer.state.values() for v in per.values()]
            engine.backward(engine(next(data)).square().mean())
            with pytest.raises(
                zoffload.NvmeSpaceError, match=r"ZeRO-Infinity.*stays in memory.*rank 1 "
            ):
                engine.step()
            optimizer = engine.optimizer.resident()
            assert all(map(torch.equal, optimizer.stepped_tensors(), masters))
            now = [v for per in optimizer.state.values() for v in per.values()]
            assert all(map(torch.equal, now, state))
        finally:
            torch.distributed.barrier()
            mounts.close()
