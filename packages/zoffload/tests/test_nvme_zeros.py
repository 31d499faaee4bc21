"""Zero runs of host storages through NVMe files: not written back at reload, so pages handed
back stay non-resident ([Note: zero pages], [Note: extents])."""

from __future__ import annotations

import ctypes
import gc
import json
import struct
import zlib
from pathlib import Path

import pytest
import torch

import zoffload
from zoffload import _nvme, release_pages
from zoffload._pages import ZERO_BLOCK
from zoffload._storage import byte_view

MB = 1 << 20


_libc = ctypes.CDLL(None)


def _rss() -> int:
    """VmRSS, less what the heap holds free (freed but kept, it makes RSS jitter by MiBs)."""
    gc.collect()
    _libc.malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _huge_page_slack() -> int:
    # With transparent huge pages always on, the first write next to a zero run may fault in
    # a whole 2 MiB page that reaches into it: allow that much at each end of the run.
    try:
        always = "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        always = False
    return 4 * MB if always else 0


def test_zeros_handed_back_stay_non_resident_through_a_file(offloader):
    def half_released(nbytes: int) -> torch.Tensor:
        t = torch.randn(nbytes // 4)  # every page resident
        release_pages(
            byte_view(t.untyped_storage())[nbytes * 3 // 16 + 123 : nbytes * 13 // 16 + 5]
        )
        return t

    # Once first, so that the pool's staging buffers, torch's kernels (code pages) and the
    # heap that their temporaries leave exist before we measure.
    warm = {"w": half_released(64 * MB)}
    offloader.offload(warm, "nvme").reload()
    t = half_released(64 * MB)  # 40 MiB of zeros in the middle, handed back
    expected = t.clone()
    rss = _rss()
    handle = offloader.offload({"t": t}, "nvme")
    handle.reload(keep=True)
    assert _rss() - rss <= 2 * MB + _huge_page_slack()
    assert torch.equal(t, expected)
    assert handle.path is not None
    (entry,) = zoffload.check_file(handle.path).storages  # holes read back as zeros
    assert sum(b - a for a, b in entry.zeros) >= 40 * MB - 2 * ZERO_BLOCK


def test_zeros_that_were_resident_come_back_equal(offloader):
    t = torch.zeros(8 * MB)
    t[:1000] = torch.randn(1000)
    t[3 * MB : 3 * MB + 17] = 1.5
    t[-5:] = -2.0
    expected = t.clone()
    handle = offloader.offload({"t": t}, "nvme")
    assert handle.path is not None
    (entry,) = _nvme.read_manifest(handle.path).storages
    assert len(entry.zeros) == 2
    handle.reload()
    assert torch.equal(t, expected)
    handle.offload()  # again, from the reloaded storage: the same runs
    handle.reload()
    assert torch.equal(t, expected)


def test_a_version_1_file_still_loads(offloader):
    tensors = {"a": torch.randn(100_000), "b": torch.arange(5000)}
    expected = {k: v.clone() for k, v in tensors.items()}
    handle = offloader.offload(tensors, "nvme")
    path = handle.path
    assert path is not None
    manifest = zoffload.check_file(path)
    assert all(not e.zeros for e in manifest.storages)
    body = json.dumps(
        {
            "token": manifest.token,
            "data_offset": manifest.data_offset,
            "data_nbytes": manifest.data_nbytes,
            "chunk_bytes": manifest.chunk_bytes,
            "chunk_crcs": [f"{c:08x}" for c in manifest.chunk_crcs],
            "storages": [[list(e.names), e.offset, e.nbytes] for e in manifest.storages],
        }
    ).encode()
    header = struct.pack("<8sIQI", b"ZOFFLOAD", 1, len(body), zlib.crc32(body)) + body
    with open(path, "r+b") as f:
        f.write(header + bytes(manifest.data_offset - len(header)))
    assert zoffload.check_file(path) == manifest
    handle.reload()
    assert all(torch.equal(tensors[k], expected[k]) for k in tensors)


@pytest.mark.parametrize("chunk_bytes", [64 << 10, 1 << 20])
def test_a_file_of_zeros_only_is_holes_that_check(tmp_path, chunk_bytes):
    off = zoffload.Offloader(pool=zoffload.HostPool(), nvme_path=tmp_path, chunk_bytes=chunk_bytes)
    t = torch.zeros(4 * MB, dtype=torch.uint8)
    handle = off.offload({"z": t}, "nvme")
    assert handle.path is not None
    manifest = zoffload.check_file(handle.path)
    assert manifest.storages[0].zeros == ((0, 4 * MB),)
    handle.reload()
    assert t.numel() == 4 * MB
    assert not bool(t.any())
    off.close()
    off.pool.close()
