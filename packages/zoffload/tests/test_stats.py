"""`zoffload.nvme_stats`: the bytes and files that moved through offload files
([Note: NVMe accounting])."""

from __future__ import annotations

from pathlib import Path

import torch

import zoffload
from zoffload._nvme import read_manifest

MB = 1 << 20


def test_counts_the_bytes_each_offload_and_reload_moves(offloader: zoffload.Offloader) -> None:
    # 1 MiB of data and 1 MiB of zeros: the zeros are a hole, neither written nor read.
    data = torch.arange(MB // 4, dtype=torch.float32)
    zeros = torch.zeros(MB // 4)
    before = zoffload.nvme_stats()
    handle = offloader.offload({"data": data, "zeros": zeros}, "nvme")
    written = zoffload.nvme_stats() - before
    path = handle.path
    assert path is not None
    header = read_manifest(path).data_offset
    assert written.files_written == 1
    assert written.files_read == 0
    # The header twice (zeros first, which also probes O_DIRECT; the real one last), the data,
    # not the zeros (a hole).
    assert MB <= written.bytes_written - 2 * header < 2 * MB
    assert written.bytes_read == 0
    assert 0 < written.write_seconds < 60

    middle = zoffload.nvme_stats()
    handle.reload()
    read = zoffload.nvme_stats() - middle
    assert read.files_read == 1
    assert read.files_written == 0
    assert read.bytes_written == 0
    # The header's manifest, checked before the data is read (its bytes, or the whole aligned
    # header where the read goes through O_DIRECT), then the data chunks.
    assert MB < read.bytes_read < 2 * MB + header
    assert read.bytes_moved == read.bytes_read
    assert 0 < read.read_seconds < 60
    assert torch.equal(data, torch.arange(MB // 4, dtype=torch.float32))


def test_snapshots_subtract_field_by_field() -> None:
    a = zoffload.NvmeStats(10, 20, 1, 2, 0.5, 0.25)
    b = zoffload.NvmeStats(3, 5, 1, 1, 0.25, 0.25)
    assert a - b == zoffload.NvmeStats(7, 15, 0, 1, 0.25, 0.0)
    assert (a - b).bytes_moved == 22


def test_other_offloaders_and_host_offloads(tmp_path: Path) -> None:
    # Counts are per process, whichever offloader wrote; host offloads move no disk bytes.
    t = torch.ones(MB // 4)
    before = zoffload.nvme_stats()
    with_own = zoffload.Offloader(pool=zoffload.HostPool(), nvme_path=tmp_path)
    try:
        with_own.offload({"t": t}, "cpu").reload()
        assert zoffload.nvme_stats() == before
        with_own.offload({"t": t}, "nvme").reload()
        moved = zoffload.nvme_stats() - before
        assert moved.files_written == moved.files_read == 1
        assert moved.bytes_written >= MB
        assert moved.bytes_read >= MB
    finally:
        with_own.close()
        with_own.pool.close()
