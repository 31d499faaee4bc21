"""zengine checkpoints against DeepSpeed's: save and load time and bytes, and consolidation memory.

Run by ``nox -s bench -- checkpoint`` (or ``python bench/bench_checkpoint.py [--quick]``).

1. Save and load at world size 2 (gloo, CPU, one torch thread per rank), ZeRO-3, fp32, for two
   models: the demo model of examples/train_gpt.py with its own config (``ds_config(3)``: AdamW,
   WarmupLR), and the 67 M-parameter GPT of the zengine benchmark's memory table (4 blocks of
   hidden 1024, vocabulary 8192) with Adam. Each library runs in its own pair of processes,
   one library after the other: build the engine, take 2 steps, save and load once untimed
   (first-call costs: zengine imports torch.distributed.checkpoint, about 1 s, on its first
   save), then ``save_checkpoint`` under REPS tags and ``load_checkpoint`` of each tag into a
   second, fresh engine, every call between barriers (rank 0's wall time from the barrier
   before to the barrier after); ROUNDS such process groups per library, zengine and DeepSpeed
   in alternating order; times are medians over all calls. Bytes: the tag directory's files.
   The loaded engine's next loss is compared with the saving engine's (0: the load restored
   the training state exactly).
2. Consolidation of the zengine checkpoint of the 67 M model into one fp32 state dict
   (``zengine consolidate``, 64 MiB read at a time) against DeepSpeed's
   ``get_fp32_state_dict_from_zero_checkpoint`` (then ``torch.save``) of its own checkpoint of
   the same model, each in a fresh process: peak RSS (VmHWM) minus the RSS after the imports,
   against the model's fp32 size. Target: zengine's extra peak under half the fp32 size (it
   streams; DeepSpeed holds the whole model and more).

zengine fsyncs every file it writes before the checkpoint counts (see [Note: a checkpoint is
good or absent]); DeepSpeed does not, so its save time does not include getting the bytes to
the disk.
"""

from __future__ import annotations

import importlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from _common import GPT, run_ranks

ROOT = Path(__file__).resolve().parent.parent
QUICK = "--quick" in sys.argv
REPS = 2 if QUICK else 3  # saves and loads per process group
ROUNDS = 1 if QUICK else 2  # process groups per library, in alternating order
LARGE = dict(vocab=8192, hidden=1024, seq=128, heads=4, blocks=4)
BUDGET_MIB = 64
LIBRARIES = ["zengine", "deepspeed"]


# ---------------------------------------------------------------------------------------------
# One rank


def _demo() -> tuple[nn.Module, dict[str, Any], int, int]:
    sys.path.insert(0, str(ROOT / "examples"))
    demo: Any = importlib.import_module("train_gpt")
    config = demo.ds_config(3, bf16=False)
    config["steps_per_print"] = 1_000_000
    return demo.GPT(), config, demo.VOCAB, demo.SEQ


def _large() -> tuple[nn.Module, dict[str, Any], int, int]:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3},
    }
    return GPT(**LARGE), config, LARGE["vocab"], LARGE["seq"]


def _engine(library: str, model_name: str) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model, config, vocab, seq = _demo() if model_name == "demo" else _large()
    module: Any = importlib.import_module(library)
    engine = module.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    micro = config["train_micro_batch_size_per_gpu"]
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    batch = (torch.randint(0, vocab, (micro, seq), generator=gen),) * 2
    return engine, batch


def _step(engine: Any, batch: Any) -> float:
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()
    return float(loss)


def _timed(call: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    call()
    dist.barrier()
    return time.perf_counter() - start


def worker(library: str, model_name: str, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    engine, batch = _engine(library, model_name)
    for _ in range(2):
        _step(engine, batch)
    tags = [f"t{i}" for i in range(REPS)]
    engine.save_checkpoint(directory, tag="warm")  # untimed: first-call costs (imports)
    saves = [_timed(lambda t=t: engine.save_checkpoint(directory, tag=t)) for t in tags]
    expected = _step(engine, batch)
    fresh, _ = _engine(library, model_name)
    fresh.load_checkpoint(directory, tag="warm")
    loads = [_timed(lambda t=t: fresh.load_checkpoint(directory, tag=t)) for t in tags]
    got = _step(fresh, batch)
    files = [p for p in (Path(directory) / tags[0]).rglob("*") if p.is_file()]
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    if dist.get_rank() == 0:
        result = {
            "saves": saves,
            "loads": loads,
            "bytes": sum(p.stat().st_size for p in files),
            "files": len(files),
            "params": params,
            "loss_diff": abs(got - expected),
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Consolidation, in a fresh process


def _rss() -> dict[str, float]:
    fields: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                fields[name] = int(value.split()[0]) * 1024
    return fields


def consolidator(library: str, checkpoint: str, out: str) -> None:
    torch.set_num_threads(1)
    if library == "zengine":
        from zengine._checkpoint import consolidate

        baseline = _rss()["VmRSS"]
        start = time.perf_counter()
        consolidate(checkpoint, out, budget=BUDGET_MIB << 20)
    else:
        zero_to_fp32: Any = importlib.import_module("deepspeed.utils.zero_to_fp32")
        baseline = _rss()["VmRSS"]
        start = time.perf_counter()
        # what convert_zero_checkpoint_to_fp32_state_dict does for one output file (its 0.19
        # version imports huggingface_hub to plan shards, which the bench venv lacks)
        torch.save(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint), out)
    seconds = time.perf_counter() - start
    print(
        "RESULT " + json.dumps({"baseline": baseline, "peak": _rss()["VmHWM"], "seconds": seconds})
    )


def _consolidate(library: str, checkpoint: Path, out: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "consolidate", library, str(checkpoint), str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{library} consolidation failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(lines[0].removeprefix("RESULT "))
    return result


# ---------------------------------------------------------------------------------------------
# The controller


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    try:
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for model_name in ("demo", "large"):
            for round_ in range(ROUNDS):
                for library in LIBRARIES if round_ % 2 == 0 else LIBRARIES[::-1]:
                    directory = work / f"{library}-{model_name}"
                    shutil.rmtree(directory, ignore_errors=True)
                    args = ["worker", library, model_name, str(directory)]
                    result = run_ranks(__file__, args, 2)[0]
                    row = rows.setdefault(
                        (model_name, library), {**result, "saves": [], "loads": []}
                    )
                    row["saves"] += result["saves"]
                    row["loads"] += result["loads"]
                    row["loss_diff"] = max(row["loss_diff"], result["loss_diff"])
        for row in rows.values():
            row["save"], row["load"] = (
                statistics.median(row["saves"]),
                statistics.median(row["loads"]),
            )
        print(
            "### Save and load, world size 2 (gloo, CPU, ZeRO-3, fp32): medians of "
            f"{ROUNDS} process groups x {REPS} calls, the libraries in alternating order; bytes "
            "of one checkpoint\n"
        )
        print("| model | library | save s | load s | MiB | files | loss diff after load |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for (model_name, library), r in rows.items():
            label = f"{model_name} ({r['params'] / 1e6:.2f} M params)"
            print(
                f"| {label} | {library} | {r['save']:.3f} | {r['load']:.3f} | "
                f"{_mib(r['bytes'])} | {r['files']} | {r['loss_diff']:.1e} |"
            )
        fp32 = rows["large", "zengine"]["params"] * 4
        print(
            f"\n### Consolidation of the 67 M model (fp32 size {_mib(fp32)} MiB) into one "
            "state dict, fresh process each\n"
        )
        print(
            "| tool | seconds | RSS after imports MiB | peak RSS MiB | extra peak MiB "
            "| extra / fp32 size | target | verdict |"
        )
        print("|---|---:|---:|---:|---:|---:|---|---|")
        for library in LIBRARIES:
            checkpoint = work / f"{library}-large"
            out = work / f"{library}.pt"
            if library == "zengine":
                c = _consolidate(library, checkpoint, out)
                name, target = f"zengine consolidate ({BUDGET_MIB} MiB batches)", "< 0.5"
            else:
                c = _consolidate(library, checkpoint, out)
                name, target = "DeepSpeed get_fp32_state_dict_from_zero_checkpoint + torch.save", ""
            extra = c["peak"] - c["baseline"]
            verdict = ("meets" if extra / fp32 < 0.5 else "misses") if target else ""
            print(
                f"| {name} | {c['seconds']:.2f} | {_mib(c['baseline'])} | {_mib(c['peak'])} | "
                f"{_mib(extra)} | {extra / fp32:.2f} | {target} | {verdict} |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(*sys.argv[2:5])
    elif len(sys.argv) > 1 and sys.argv[1] == "consolidate":
        consolidator(*sys.argv[2:5])
    else:
        main()
