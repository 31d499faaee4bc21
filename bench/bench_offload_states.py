"""``engine.offload_states`` / ``reload_states`` to NVMe at world size 2, ZeRO stages 1-3: the
memory given back against the state the engine holds, and the memory after reload against
before ([Note: offload_states' footprint]).

Run by ``nox -s bench -- offload_states`` (or ``python bench/bench_offload_states.py``); prints
markdown. Two models: the demo's GPT (examples/train_gpt.py, as `nox -s demo` trains it) and
the 8 x Linear(1024, 1024) of issue 23 (fp32, Adam). Each rank trains 3 steps, then runs 5
offload/reload cycles; RSS is taken with glibc's free heap handed back first, the state's
resident bytes with ``mincore`` over its storages before the first offload (only then: a page of
zeros that a reload handed back and something read since maps the shared zero page, which
``mincore`` counts and RSS does not). ``ZOFFLOAD_BENCH_DIR`` picks the disk.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from _common import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CYCLES, STEPS = 5, 3
_PAGE = 4096


def _rss_mib() -> float:
    from zengine._offload import trim_heap

    trim_heap()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _resident_mib(storages: list[torch.UntypedStorage]) -> float:
    """MiB of these storages' pages in memory now."""
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    total = 0
    for storage in storages:
        if not storage.nbytes():
            continue
        start = storage.data_ptr() // _PAGE * _PAGE
        pages = -(-(storage.data_ptr() + storage.nbytes() - start) // _PAGE)
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(start, pages * _PAGE, vec) == 0:
            total += min(sum(b & 1 for b in vec.raw) * _PAGE, storage.nbytes())
    return total / (1 << 20)


def _demo() -> tuple[nn.Module, dict[str, Any], Iterator[tuple[torch.Tensor, ...]]]:
    """The demo's model, config and data (examples/train_gpt.py, imported from its file)."""
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    assert spec is not None
    assert spec.loader is not None
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)

    config = train_gpt.ds_config(3, bf16=False)
    data = train_gpt.batches(None, 0, int(torch.distributed.get_rank()), torch.device("cpu"))
    return train_gpt.GPT(), config, data


def _linears() -> tuple[nn.Module, dict[str, Any], Iterator[tuple[torch.Tensor, ...]]]:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3},
    }
    g = torch.Generator().manual_seed(int(torch.distributed.get_rank()))

    def data() -> Iterator[tuple[torch.Tensor, ...]]:
        while True:
            yield (torch.randn(4, 1024, generator=g),)

    return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8))), config, data()


class _SquareMean(nn.Module):
    """The Linear stack's loss: its output's mean square."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.inner(x).square().mean()
        return loss


def _worker(model_name: str, stage: int, folder: str) -> None:
    import zengine
    from zengine._offload._states import state_tensors
    from zoffload import OffloadStateTypeEnum

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model, config, data = _demo() if model_name == "demo" else _linears()
    if model_name != "demo":
        model = _SquareMean(model)
    config = dict(config, steps_per_print=10**6)
    config["zero_optimization"] = dict(config["zero_optimization"], stage=stage)
    engine, *_ = zengine.initialize(model=model, config=config)
    for _ in range(STEPS * engine.gradient_accumulation_steps()):
        loss = engine(*next(data))
        engine.backward(loss)
        engine.step()
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage()
        for s in OffloadStateTypeEnum
        for t in state_tensors(engine, s).values()
    }
    held = engine.memory_held()["total"].get("cpu", 0) / (1 << 20)
    resident = _resident_mib(list(storages.values()))
    cycles = []
    for _ in range(CYCLES):
        before = _rss_mib()
        start = time.perf_counter()
        engine.offload_states(device="nvme", nvme_path=folder)
        offload_s = time.perf_counter() - start
        away = _rss_mib()
        start = time.perf_counter()
        engine.reload_states()
        reload_s = time.perf_counter() - start
        cycles.append(
            {
                "freed": before - away,
                "after_vs_before": _rss_mib() - before,
                "offload_ms": 1000 * offload_s,
                "reload_ms": 1000 * reload_s,
            }
        )
    loss = engine(*next(data))  # training goes on
    engine.backward(loss)
    engine.step()
    print("RESULT " + json.dumps({"held": held, "resident": resident, "cycles": cycles}))


def main() -> None:
    folder = tempfile.mkdtemp(
        prefix="zengine-offload-states-bench-", dir=os.environ.get("ZOFFLOAD_BENCH_DIR")
    )
    rows = []
    try:
        for model in ("demo", "linears"):
            for stage in (1, 2, 3):
                ranks = run_ranks(__file__, ["--worker", model, str(stage), folder], world=2)
                rows.append((model, stage, ranks))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"### offload_states(device='nvme') and reload_states(), world size 2 (gloo, CPU): "
        f"{CYCLES} cycles after {STEPS} steps; MiB per rank (rank 0 / rank 1); RSS with the "
        "heap trimmed\n"
    )
    print(
        "| model | stage | state held (allocated, resident) | freed by offload, cycle 1 | "
        "freed / resident, cycle 1 | freed, cycles 2-5 (median) | "
        "RSS after reload - before: cycle 1, cycles 2-5 (max) | "
        "offload ms, reload ms (medians) |"
    )
    print("|---|---:|---|---|---|---|---|---|")
    labels = {"demo": "demo GPT", "linears": "8 x Linear(1024)"}
    for model, stage, ranks in rows:

        def per_rank(fmt: str, key: Any, ranks: list[dict[str, Any]] = ranks) -> str:
            return " / ".join(fmt.format(key(r)) for r in ranks)

        print(
            f"| {labels[model]} | {stage} | "
            + per_rank("{:.1f}", lambda r: r["held"])
            + ", "
            + per_rank("{:.1f}", lambda r: r["resident"])
            + " | "
            + per_rank("{:.1f}", lambda r: r["cycles"][0]["freed"])
            + " | "
            + per_rank("{:.0%}", lambda r: r["cycles"][0]["freed"] / max(r["resident"], 1e-9))
            + " | "
            + per_rank("{:.1f}", lambda r: statistics.median(c["freed"] for c in r["cycles"][1:]))
            + " | "
            + per_rank("{:+.1f}", lambda r: r["cycles"][0]["after_vs_before"])
            + ", "
            + per_rank("{:+.1f}", lambda r: max(c["after_vs_before"] for c in r["cycles"][1:]))
            + " | "
            + per_rank("{:.0f}", lambda r: statistics.median(c["offload_ms"] for c in r["cycles"]))
            + ", "
            + per_rank("{:.0f}", lambda r: statistics.median(c["reload_ms"] for c in r["cycles"]))
            + " |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
