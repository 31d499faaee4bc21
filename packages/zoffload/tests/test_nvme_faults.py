"""Real faults under an NVMe path: a full disk, a read-only one, a file size limit hit mid-write,
a path that is a file, and the swap folders a killed process leaves. The disks are tmpfs
mounts (`tiny_mount`, root only); nothing of zoffload is simulated."""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zoffload

from .conftest import swap_files


def test_a_full_disk_is_named_and_nothing_moves(tiny_mount, storage_bytes):
    nvme = tiny_mount(64 << 10) / "swap"
    tensors = {"a": torch.randn(1 << 18), "b": torch.arange(100.0)}
    before = {k: storage_bytes(t) for k, t in tensors.items()}
    off = zoffload.Offloader(pool=zoffload.HostPool(), nvme_path=nvme)
    for non_blocking in (False, True):
        with pytest.raises(zoffload.NvmeSpaceError) as info:
            off.offload(tensors, "nvme", non_blocking=non_blocking).wait()
        error = info.value
        assert str(nvme) in str(error)
        assert error.needed is not None
        assert error.free is not None
        assert error.needed > (1 << 20) > error.free
        assert f"{error.needed} bytes" in str(error)
        assert f"{error.free} bytes" in str(error)
        assert all(torch.equal(storage_bytes(t), before[k]) for k, t in tensors.items())
        assert all(zoffload.handle_of(t) is None for t in tensors.values())
        assert not swap_files(nvme)  # no partial file
    small = {"b": tensors["b"]}  # what fits still moves
    off.offload(small, "nvme").reload()
    assert torch.equal(storage_bytes(small["b"]), before["b"])
    off.close()


def test_read_only_and_not_a_directory_are_named(tiny_mount, tmp_path):
    ro = tiny_mount(1 << 20, read_only=True)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    t = torch.randn(64)
    for path, problem in [
        (ro, "read-only"),
        (ro / "sub", "read-only"),
        (a_file, "not a directory"),
        (a_file / "sub", "not a directory"),
    ]:
        found = zoffload.inspect_folder(path, 10)
        assert found.problem is not None
        assert problem in found.problem
        with pytest.raises(zoffload.NvmeError, match=problem) as info:
            zoffload.offload({"t": t}, "nvme", nvme_path=path)
        assert str(path) in str(info.value)
        assert zoffload.handle_of(t) is None
        assert t.untyped_storage().nbytes() == 256


def test_a_write_that_fails_midway_leaves_no_file(tmp_path, storage_bytes):
    nvme = tmp_path / "nvme"
    tensors = {"a": torch.randn(1 << 20)}  # 4 MiB, written in 64 KiB chunks
    before = storage_bytes(tensors["a"])
    off = zoffload.Offloader(pool=zoffload.HostPool(), nvme_path=nvme, chunk_bytes=64 << 10)
    off.offload({"probe": torch.ones(1)}, "nvme")  # the swap folder exists before the limit
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # Python ignores SIGXFSZ
    try:
        with pytest.raises(zoffload.NvmeError, match="File too large") as info:
            off.offload(tensors, "nvme")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(nvme) in str(info.value)
    assert torch.equal(storage_bytes(tensors["a"]), before)
    assert zoffload.handle_of(tensors["a"]) is None
    assert [f.name.endswith(".swap") for f in swap_files(nvme)] == [True]  # the probe only
    off.close()


def test_a_write_held_until_commit(tmp_path, storage_bytes):
    t = torch.randn(1000)
    before = storage_bytes(t)
    off = zoffload.Offloader(pool=zoffload.HostPool(), nvme_path=tmp_path)
    handle = off.offload({"t": t}, "nvme", commit=False)
    assert handle.state == "written"
    assert handle.path is not None
    assert handle.path.exists()
    assert torch.equal(storage_bytes(t), before)  # the bytes are still here
    handle.abandon()  # another rank failed: the file goes, the tensor stays
    assert handle.state == "resident"
    assert not swap_files(tmp_path)
    assert zoffload.handle_of(t) is None
    handle = off.offload({"t": t}, "nvme", commit=False, non_blocking=True)
    handle.commit()
    assert handle.state == "offloaded"
    assert t.untyped_storage().nbytes() == 0
    handle.reload()
    assert torch.equal(storage_bytes(t), before)
    with pytest.raises(ValueError, match="commit=False"):
        off.offload({"t": t}, "cpu", commit=False)
    off.close()


_CLAIM = """
import os, signal, sys, time, torch, zoffload
off = zoffload.Offloader(nvme_path=sys.argv[1])
off.offload({"x": torch.randn(1 << 16)}, "nvme")
print("written", flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def _claimer(nvme: Path, how: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CLAIM), str(nvme), how],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "written\n"
    return child


def test_swap_files_of_a_killed_process_go_at_the_next_start(tmp_path, caplog):
    nvme = tmp_path / "nvme"
    alive = _claimer(nvme, "sleep")  # a live process sharing the path keeps its files
    try:
        killed = _claimer(nvme, "kill")
        assert killed.wait(60) == -signal.SIGKILL
        stale, live = sorted(nvme.iterdir(), key=lambda d: str(killed.pid) not in d.name)
        assert str(killed.pid) in stale.name
        assert str(alive.pid) in live.name
        foreign = nvme / "zoffload-other"  # our names, no marker: not ours to remove
        foreign.mkdir()
        (foreign / f"zoffload-{killed.pid}-000000.swap").write_bytes(b"x" * 4096)
        stale_bytes = sum(f.stat().st_blocks * 512 for f in swap_files(stale))
        with caplog.at_level(logging.WARNING, logger="zoffload"):
            off = zoffload.Offloader(pool=zoffload.HostPool(), nvme_path=nvme)
            off.offload({"y": torch.ones(8)}, "nvme").reload()
        assert not stale.exists()
        assert live.exists()
        assert len(swap_files(live)) == 1
        assert foreign.exists()
        assert len(swap_files(foreign)) == 1
        assert f"removed {stale}" in caplog.text
        assert f"{stale_bytes} bytes freed" in caplog.text
        assert str(live) not in caplog.text
        off.close()
    finally:
        alive.kill()
        alive.wait(60)
    assert zoffload.sweep_stale(nvme) == [live]  # gone once its owner is
