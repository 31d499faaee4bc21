"""Swapping the same tensors out and in many times: ``reload(keep=True)`` keeps the copy, and
``handle.offload(rewrite=False)`` empties the tensors again without moving a byte."""

from __future__ import annotations

import pytest
import torch

import zoffload
from zoffload import OffloadChecksumError, OffloadError

DEVICES = ["cpu", "nvme"]


def some() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    tensors = {"w": torch.randn(50_000), "step": torch.arange(300)}
    return tensors, {k: v.clone() for k, v in tensors.items()}


def empty(tensors: dict[str, torch.Tensor]) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in tensors.values())


def equal(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(tensors[k], expected[k]) for k in tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_an_unchanged_swap_moves_nothing(offloader, device):
    tensors, expected = some()
    handle = offloader.offload(tensors, device)
    handle.reload(keep=True)
    assert equal(tensors, expected)
    if device == "nvme":
        assert handle.path is not None
        inode = handle.path.stat().st_ino
    in_use = offloader.pool.stats().in_use_bytes
    assert in_use >= (handle.nbytes if device == "cpu" else 0)
    for _ in range(3):
        handle.offload(rewrite=False)
        assert empty(tensors)
        holder = zoffload.handle_of(tensors["w"])
        assert holder is not None
        assert holder is handle
        handle.reload(keep=True)
        assert equal(tensors, expected)
    assert offloader.pool.stats().in_use_bytes == in_use  # nothing new was allocated
    if device == "nvme":
        assert handle.path.stat().st_ino == inode  # nothing was written
    handle.discard_copy()
    assert handle.path is None
    assert offloader.pool.stats().in_use_bytes == 0


@pytest.mark.parametrize("device", DEVICES)
def test_changed_bytes_are_written_again(offloader, device):
    tensors, _ = some()
    handle = offloader.offload(tensors, device)
    handle.reload(keep=True)
    tensors["w"].mul_(2)
    expected = {k: v.clone() for k, v in tensors.items()}
    handle.offload()  # rewrite=True: the default
    assert empty(tensors)
    handle.reload()  # no copy kept this time
    assert equal(tensors, expected)
    assert handle.path is None
    assert offloader.pool.stats().in_use_bytes == 0


@pytest.mark.parametrize("device", DEVICES)
def test_without_a_kept_copy_rewrite_false_still_moves_the_bytes(offloader, device):
    tensors, _ = some()
    handle = offloader.offload(tensors, device)
    handle.reload()
    tensors["step"].add_(1)
    expected = {k: v.clone() for k, v in tensors.items()}
    handle.offload(rewrite=False)
    handle.reload()
    assert equal(tensors, expected)


def test_a_verifying_handle_catches_a_false_unchanged(offloader):
    tensors, _ = some()
    handle = offloader.offload(tensors, "nvme", verify=True)
    handle.reload(keep=True)
    tensors["w"][7] += 1
    with pytest.raises(OffloadChecksumError, match="'w'"):
        handle.offload(rewrite=False)
    assert not empty(tensors)  # nothing was freed
    assert handle.state == "resident"
    handle.discard_copy()


def test_misuse_is_refused(offloader):
    tensors, _ = some()
    handle = offloader.offload(tensors, "nvme")
    with pytest.raises(OffloadError, match="not resident"):
        handle.offload()
    with pytest.raises(OffloadError, match="the copy is where the bytes are"):
        handle.discard_copy()
    handle.reload(keep=True)
    tensors["w"].untyped_storage().resize_(4)
    with pytest.raises(OffloadError, match=r"'?w'? changed size"):
        handle.offload(rewrite=False)
