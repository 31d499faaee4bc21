"""zoffload's offload/reload speed against the best plain copy measured in the same run.

Run by ``nox -s bench -- zoffload`` (or ``python bench/bench_zoffload.py``); prints markdown.

1. NVMe (any machine): offload and reload GB/s of a set of tensors through zoffload's files
   (O_DIRECT where allowed, chunked, checksummed, fsynced, renamed) against ``dd`` writing and
   reading the same number of bytes sequentially (``oflag=direct conv=fsync`` /
   ``iflag=direct``; a plain Python write + fsync where ``dd`` is missing), medians of
   ``ZOFFLOAD_BENCH_REPS`` interleaved rounds. The reload is timed twice from each file: once
   keeping the file (``reload(keep=True)``: the read alone, as ``dd``'s) and once as usual,
   deleting it. ``ZOFFLOAD_BENCH_DIR`` picks the disk (default: a temporary directory),
   ``ZOFFLOAD_BENCH_MB`` the size.
2. GPU (only with CUDA): pinned offload and reload GB/s against one large ``copy_`` between
   the GPU and a torch pinned buffer of the same size, first cycle and steady state apart,
   plus the device memory freed against the state's size.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import zoffload

MB = 1 << 20
TOTAL_MB = int(os.environ.get("ZOFFLOAD_BENCH_MB", "512"))
REPS = int(os.environ.get("ZOFFLOAD_BENCH_REPS", "5"))
GPU_CYCLES = 10


def _state(total_bytes: int, device: str) -> dict[str, torch.Tensor]:
    """A ZeRO-like mix: a few large flat buffers and many small ones (5% of the bytes)."""
    large = int(total_bytes * 0.95) // 4
    state = {f"flat{i}": torch.randn(large // 4, device=device) for i in range(4)}
    small_bytes = total_bytes - 4 * (large // 4) * 4
    for i in range(max(1, small_bytes // (64 << 10))):
        state[f"small{i}"] = torch.randn((64 << 10) // 4, device=device)
    return state


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _offload_timed(
    off: zoffload.Offloader, state: dict[str, torch.Tensor], device: str
) -> tuple[float, zoffload.OffloadHandle]:
    start = time.perf_counter()
    handle = off.offload(state, device)
    if device == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, handle


def _dd(args: list[str]) -> None:
    subprocess.run(["dd", *args, "status=none"], check=True)


def _baselines(directory: Path, nbytes: int) -> tuple[str, Callable[[], None], Callable[[], None]]:
    """(name, sequential write, sequential read) of ``nbytes`` in ``directory``; the write
    goes to a new file, as zoffload's do (see `_clear_baseline`)."""
    path = directory / "baseline.bin"
    count = max(1, nbytes // (8 * MB))
    if shutil.which("dd"):
        write_args = [f"of={path}", "if=/dev/zero", "bs=8M", f"count={count}", "conv=fsync"]
        read_args = [f"if={path}", "of=/dev/null", "bs=8M"]
        try:
            _dd([*write_args, "oflag=direct"])
            _dd([*read_args, "iflag=direct"])
            write_args.append("oflag=direct")
            read_args.append("iflag=direct")
            name = "dd bs=8M direct"
        except subprocess.CalledProcessError:
            name = "dd bs=8M (no O_DIRECT here)"
        return name, lambda: _dd(write_args), lambda: _dd(read_args)
    block = os.urandom(8 * MB)

    def write() -> None:
        with open(path, "wb") as f:
            for _ in range(count):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    def read() -> None:
        with open(path, "rb") as f:
            while f.read(8 * MB):
                pass

    return "python write+fsync / read", write, read


def nvme_table(directory: Path) -> None:
    state = _state(TOTAL_MB * MB, "cpu")
    expected = {k: v.clone() for k, v in state.items()}
    nbytes = sum(t.untyped_storage().nbytes() for t in state.values())
    off = zoffload.Offloader(nvme_path=directory)
    name, base_write, base_read = _baselines(directory, nbytes)
    rows: dict[str, list[float]] = {k: [] for k in ("off", "kept", "re", "bw", "br")}
    direct = None
    for _ in range(REPS):  # interleaved, so drift in the disk hits both alike
        _clear_baseline(directory)
        seconds, handle = _offload_timed(off, state, "nvme")
        rows["off"].append(seconds)
        direct = handle.direct_io
        rows["kept"].append(_timed(functools.partial(handle.reload, keep=True)))
        handle.offload(rewrite=False)  # empties the tensors again; the file is unchanged
        rows["re"].append(_timed(handle.reload))
        # Untimed, as dd's file's deletion: the reload's file is freed (trimmed, with
        # ``discard``) on zoffload's thread, which would otherwise overlap dd's write.
        off.io.wait_removals()
        rows["bw"].append(_timed(base_write))
        rows["br"].append(_timed(base_read))
    assert all(torch.equal(state[k], expected[k]) for k in state), "not bit-exact"
    off.close()
    med = {k: _gbps(nbytes, statistics.median(v)) for k, v in rows.items()}
    crc = zoffload._nvme._crc32.__module__
    print(f"### NVMe: {nbytes / MB:.0f} MiB in {len(state)} tensors, under {directory}")
    print(f"(zoffload O_DIRECT: {direct}, CRC-32 from {crc}; medians of {REPS} rounds)\n")
    print("| | write GB/s | read GB/s |")
    print("|---|---|---|")
    print(f"| zoffload offload / reload | {med['off']:.2f} | {med['re']:.2f} |")
    print(f"| zoffload reload(keep=True) | | {med['kept']:.2f} |")
    print(f"| {name} | {med['bw']:.2f} | {med['br']:.2f} |")
    print(f"| zoffload / baseline | {med['off'] / med['bw']:.0%} | {med['re'] / med['br']:.0%} |")
    print(f"| reload(keep=True) / baseline | | {med['kept'] / med['br']:.0%} |")
    print("\nEach round (GB/s): " + _rounds(nbytes, rows) + "\n")


def _clear_baseline(directory: Path) -> None:
    # Deleted untimed: overwriting it would free its blocks inside dd's time, and where the
    # filesystem is mounted with ``discard`` that waits for the disk (0.1 s per 512 MiB here).
    (directory / "baseline.bin").unlink(missing_ok=True)


def _rounds(nbytes: int, rows: dict[str, list[float]]) -> str:
    return "; ".join(
        f"{k} " + " ".join(f"{_gbps(nbytes, s):.2f}" for s in v) for k, v in rows.items()
    )


def _cuda_time(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _torch_pinned_copy(nbytes: int) -> tuple[list[float], list[float]]:
    """Seconds of one large D2H and H2D ``copy_`` with a torch pinned buffer, 5 runs each."""
    device_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = [_cuda_time(lambda: host_buf.copy_(device_buf, non_blocking=True)) for _ in range(5)]
    h2d = [_cuda_time(lambda: device_buf.copy_(host_buf, non_blocking=True)) for _ in range(5)]
    return d2h, h2d


def gpu_table() -> None:
    if not torch.cuda.is_available():
        print("### GPU: skipped (no CUDA device on this machine)\n")
        return
    total = int(os.environ.get("ZOFFLOAD_BENCH_GPU_MB", "4096")) * MB
    state = _state(total, "cuda")
    nbytes = sum(t.untyped_storage().nbytes() for t in state.values())
    d2h, h2d = _torch_pinned_copy(nbytes)
    off = zoffload.Offloader(pool=zoffload.HostPool())
    offs, reloads, freed = [], [], []
    for _ in range(GPU_CYCLES):
        before = torch.cuda.memory_allocated()
        torch.cuda.synchronize()
        seconds, handle = _offload_timed(off, state, "cpu")
        offs.append(seconds)
        freed.append(before - torch.cuda.memory_allocated())
        reloads.append(_cuda_time(handle.reload))
    ref_d2h, ref_h2d = _gbps(nbytes, min(d2h[1:])), _gbps(nbytes, min(h2d[1:]))
    first_off, first_re = _gbps(nbytes, offs[0]), _gbps(nbytes, reloads[0])
    steady_off = _gbps(nbytes, statistics.median(offs[1:]))
    steady_re = _gbps(nbytes, statistics.median(reloads[1:]))
    backend = "cupy" if zoffload._cuda.cupy() is not None else "torch"
    print(f"### GPU: {nbytes / MB:.0f} MiB in {len(state)} tensors, pinned, backend {backend}\n")
    print("| | offload (D2H) GB/s | reload (H2D) GB/s |")
    print("|---|---|---|")
    print(f"| one torch pinned copy (best) | {ref_d2h:.1f} | {ref_h2d:.1f} |")
    print(f"| zoffload first cycle | {first_off:.1f} | {first_re:.1f} |")
    print(f"| zoffload steady (median) | {steady_off:.1f} | {steady_re:.1f} |")
    print(f"| steady / torch copy | {steady_off / ref_d2h:.0%} | {steady_re / ref_h2d:.0%} |")
    print(f"\nmemory freed: {min(freed) / nbytes:.2%} of the state's {nbytes} bytes")
    print(f"pool: {off.pool.stats()}\n")
    off.close()


def main() -> None:
    print("## zoffload\n")
    print(f"torch {torch.__version__}, zoffload {zoffload.__version__}, python {sys.version[:6]}\n")
    given = os.environ.get("ZOFFLOAD_BENCH_DIR")
    with tempfile.TemporaryDirectory(dir=given, prefix="zoffload-bench-") as tmp:
        nvme_table(Path(tmp))
    gpu_table()


if __name__ == "__main__":
    main()
