"""Loading DeepSpeed's own ZeRO-3 checkpoint: zstack's ``load_checkpoint`` against DeepSpeed's,
on the same files.

Run by ``nox -s bench -- deepspeed_checkpoint`` (or ``python bench/bench_deepspeed_checkpoint.py
[--quick]`` where the real DeepSpeed, Transformers and zengine are importable).

The model is `bench_load`'s Llama (hidden 1024, 14 layers, vocabulary 32000, untied head:
245 M parameters, 936 MiB in fp32). DeepSpeed 0.19.8 trains it one step at ZeRO-3 on 2 ranks
(gloo, CPU, fp32, torch's AdamW as the client optimizer, so that no DeepSpeed op is compiled)
and saves a checkpoint: per rank its fp32 masters and the two Adam moments (about 1.4 GiB a
rank). Then, each contender in a fresh pair of processes every round, rotating order, ROUNDS
rounds: the same model built under its ZeRO-3 ``Init``, the same engine config, and
``engine.load_checkpoint(save_dir)`` of DeepSpeed's folder:

- DeepSpeed: its own load (each rank ``torch.load``s its files);
- zstack: ``zengine``'s load of DeepSpeed's folder (each rank maps the files and copies the
  ranges it owns, see [Note: reading DeepSpeed's layouts]).

Time: rank 0's wall time of the ``load_checkpoint`` call, between barriers. Memory: each rank's
peak RSS during the load (VmHWM, reset through /proc/self/clear_refs just before) minus its RSS
before it. Check (untimed): after the load each engine computes the loss of one fixed batch;
zstack's must equal DeepSpeed's.
"""

from __future__ import annotations

import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from _common import run_ranks

QUICK = "--quick" in sys.argv
ROUNDS = 1 if QUICK else 3
CONTENDERS = ["zstack", "DeepSpeed"]
LLAMA: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=14,
    num_attention_heads=16,
    vocab_size=32000,
    tie_word_embeddings=False,
)
CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000,
    "zero_optimization": {"stage": 3},
}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status")


def _batch() -> torch.Tensor:
    return torch.randint(
        0, LLAMA["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(3)
    )


def _engine(library: str) -> Any:
    """The model built under the library's ZeRO-3 Init, in an engine of `CONFIG`."""
    lib: Any
    if library == "DeepSpeed":
        lib = importlib.import_module("deepspeed")
        init: Any = lib.zero.Init(config_dict_or_path=CONFIG)
    else:
        import zpartition

        lib = importlib.import_module("zengine")
        init = zpartition.Init()
    torch.manual_seed(0)
    with init:
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = lib.initialize(model=model, optimizer=optimizer, config=CONFIG)
    return engine


def _loss(engine: Any) -> float:
    tokens = _batch()
    with torch.no_grad():
        return float(engine(input_ids=tokens, labels=tokens).loss)


def save(directory: str) -> None:
    """DeepSpeed trains one step and saves (a rank)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    engine = _engine("DeepSpeed")
    tokens = _batch()
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(directory)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"saved": directory}), flush=True)
    dist.destroy_process_group()


def load(contender: str, directory: str) -> None:
    """One contender's engine loads DeepSpeed's checkpoint (a rank)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    engine = _engine(contender)
    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    dist.barrier()
    start = time.perf_counter()
    engine.load_checkpoint(directory)
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - baseline
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    loss = _loss(engine)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"seconds": seconds, "peaks": peaks, "loss": loss}))
    dist.destroy_process_group()


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="bench_ds_checkpoint_"))
    try:
        run_ranks(__file__, ["save", str(work)], 2)
        size = sum(f.stat().st_size for f in work.rglob("*.pt"))
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
        for round_ in range(ROUNDS):
            shift = round_ % len(CONTENDERS)
            for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:
                runs[contender].append(run_ranks(__file__, ["load", contender, str(work)], 2)[0])
        _report(runs, size)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _report(runs: dict[str, list[dict[str, Any]]], size: int) -> None:
    print(
        f"### Loading DeepSpeed's ZeRO-3 checkpoint of the 245 M Llama ({_mib(size)} MiB of "
        f"files) at world size 2 (gloo, CPU): load_checkpoint, medians of {ROUNDS} rounds, "
        "fresh processes each, rotating order\n"
    )
    print(
        "| contender | load s | vs DeepSpeed | peak RSS during the load per rank MiB | loss after |"
    )
    print("|---|---:|---:|---|---:|")
    seconds = {c: statistics.median(r["seconds"] for r in rs) for c, rs in runs.items()}
    for c, rs in runs.items():
        peaks = [statistics.median(r["peaks"][k] for r in rs) for k in range(2)]
        print(
            f"| {c} | {seconds[c]:.2f} | {seconds[c] / seconds['DeepSpeed']:.2f}x "
            f"| {_mib(peaks[0])}, {_mib(peaks[1])} | {rs[0]['loss']:.6f} |"
        )
    same = {r["loss"] for rs in runs.values() for r in rs}
    print(f"\nThe loaded weights give {'one loss' if len(same) == 1 else 'DIFFERENT losses'}.")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "save":
        save(sys.argv[2])
    elif len(sys.argv) > 3 and sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3])
    else:
        main()
