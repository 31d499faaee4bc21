"""Loading a Hugging Face checkpoint into a ZeRO-3 model: zengine's own loader against
Transformers' ZeRO-3 path.

Run by ``nox -s bench -- load`` (or ``python bench/bench_load.py [--quick]``; Transformers,
Accelerate and the compatibility ``deepspeed`` must be importable).

The model is a Llama from ``transformers.LlamaConfig`` (hidden 1024, intermediate 2816, 14
layers, 16 heads, vocabulary 32000, untied head: 245 M parameters, 936 MiB in fp32), saved by
``save_pretrained`` in fp32 safetensors with ``max_shard_size="200MB"`` (5 shards and
``model.safetensors.index.json``) to a temporary directory. World size 2, gloo, CPU, one torch
thread per rank. The contenders, each in a fresh pair of processes every round, in rotating
order for ROUNDS rounds:

- zstack: ``with no_init_weights(), zpartition.Init(sync_module_states=False): model =
  LlamaForCausalLM(config)`` (the config read with ``AutoConfig.from_pretrained``; no rank-0
  broadcast of values the load overwrites), then ``zengine.load_safetensors(model,
  directory)``: each rank maps the shards and copies only its own chunk of each parameter.
- Transformers: a ``HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, ...})`` kept alive,
  then ``AutoModelForCausalLM.from_pretrained(directory)``, on zstack through the compatibility
  ``deepspeed`` package: it builds the model under ``deepspeed.zero.Init`` (rank 0's values of
  each module broadcast, as DeepSpeed does) and rank 0 reads every tensor, each module's
  parameters then broadcast by ``GatheredParameters(modifier_rank=0)``.

Both ranks import everything first; the time is rank 0's wall time from a barrier before the
construction to a barrier after the load, and for zstack also split at the end of the
construction (rank 0's clock; the load starts by agreeing with the other rank, so it includes
any wait for that rank's construction). Memory: each rank's peak RSS (VmHWM, reset through
/proc/self/clear_refs after the imports) minus its RSS after the imports, against the model's
fp32 size. Afterwards (untimed) each rank gathers every parameter, one at a time, and rank 0
reports a digest of its bytes; each contender must match the checkpoint's tensors bit for
bit. Targets (from the issue): zstack at least 3x faster, and its peak per rank at most 0.6x
the fp32 model.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import itertools
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
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights

import zengine
import zpartition
from _common import run_ranks

QUICK = "--quick" in sys.argv
ROUNDS = 1 if QUICK else 3
CONTENDERS = ["zstack", "transformers"]
LABELS = {
    "zstack": "zstack: Init(sync_module_states=False) + zengine.load_safetensors",
    "transformers": "Transformers from_pretrained, ZeRO-3 (compat deepspeed)",
}
LLAMA: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=14,
    num_attention_heads=16,
    vocab_size=32000,
    tie_word_embeddings=False,
)
SPEEDUP_TARGET, MEMORY_TARGET = 3.0, 0.6


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} in /proc/self/status")


def checksum(tensor: torch.Tensor) -> str:
    """A digest of the tensor's bytes (read in place, not copied)."""
    tensor = tensor.detach().contiguous()
    size = tensor.numel() * tensor.element_size()
    raw = (ctypes.c_char * size).from_address(tensor.data_ptr()) if size else b""
    return hashlib.blake2b(memoryview(raw), digest_size=16).hexdigest()


# ---------------------------------------------------------------------------------------------
# One rank


def _zstack(directory: str, marks: list[float]) -> Any:
    config = AutoConfig.from_pretrained(directory)
    with no_init_weights(), zpartition.Init(sync_module_states=False):
        model = LlamaForCausalLM(config)
    marks.append(time.perf_counter())
    zengine.load_safetensors(model, directory)
    return model


def _transformers(directory: str, marks: list[float]) -> Any:
    return AutoModelForCausalLM.from_pretrained(directory)


def worker(contender: str, directory: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import deepspeed  # noqa: F401 - imported by all before the baseline (Transformers would)

    # modules typed as Any: where Transformers is installed its functions are untyped
    hf: Any = importlib.import_module("transformers")
    hf.logging.set_verbosity_error()
    hf_config = None
    if contender == "transformers":  # Transformers looks it up while it lives
        ds = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
        hf_config = hf.integrations.HfDeepSpeedConfig(ds)
    load = _transformers if contender == "transformers" else _zstack
    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    dist.barrier()
    marks = [time.perf_counter()]
    model = load(directory, marks)
    dist.barrier()
    marks.append(time.perf_counter())
    peak = _status("VmHWM") - baseline
    sums = {}
    for name, p in model.named_parameters():
        with zpartition.GatheredParameters([p]):
            sums[name] = checksum(p.data)
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        steps = [b - a for a, b in itertools.pairwise(marks)]  # [total] or [construction, load]
        result = {"seconds": sum(steps), "steps": steps, "peaks": peaks, "sums": sums}
        print("RESULT " + json.dumps(result), flush=True)
    del hf_config
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The controller


def _save(directory: Path) -> tuple[int, dict[str, str]]:
    """The checkpoint; its parameter count and each tensor's digest."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size="200MB")
    del model
    sums = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                sums[name] = checksum(f.get_tensor(name))
    return params, sums


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="bench_load_"))
    try:
        params, expected = _save(work)
        shards = len(list(work.glob("*.safetensors")))
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
        for round_ in range(ROUNDS):
            shift = round_ % len(CONTENDERS)
            for contender in CONTENDERS[shift:] + CONTENDERS[:shift]:
                args = ["worker", contender, str(work)]
                runs[contender].append(run_ranks(__file__, args, 2)[0])
        _report(runs, expected, params, shards)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _report(
    runs: dict[str, list[dict[str, Any]]], expected: dict[str, str], params: int, shards: int
) -> None:
    fp32 = params * 4
    seconds = {c: statistics.median(r["seconds"] for r in rs) for c, rs in runs.items()}
    print(
        f"### Loading a Llama of {params / 1e6:.0f} M parameters (fp32 {_mib(fp32)} MiB, "
        f"{shards} safetensors shards) at world size 2 (gloo, CPU): construction + load, "
        f"medians of {ROUNDS} rounds, fresh processes each, rotating order\n"
    )
    print(
        "| contender | construction + load s | of which load s | vs zstack "
        "| peak RSS per rank MiB (rank 0, rank 1) | max peak / fp32 size | weights |"
    )
    print("|---|---:|---:|---:|---|---:|---|")
    for c, rs in runs.items():
        peaks = [statistics.median(r["peaks"][k] for r in rs) for k in range(2)]
        split = [r["steps"][1] for r in rs if len(r["steps"]) == 2]
        load = f"{statistics.median(split):.2f}" if split else "-"
        same = all(r["sums"] == expected for r in rs)
        print(
            f"| {LABELS[c]} | {seconds[c]:.2f} | {load} | {seconds[c] / seconds['zstack']:.2f}x "
            f"| {_mib(peaks[0])}, {_mib(peaks[1])} | {max(peaks) / fp32:.2f} | "
            f"{'bit-identical to the checkpoint' if same else 'DIFFER from the checkpoint'} |"
        )
    speedup = seconds["transformers"] / seconds["zstack"]
    worst = max(max(r["peaks"]) for r in runs["zstack"]) / fp32
    print(
        f"\nTargets: zstack >= {SPEEDUP_TARGET:g}x faster than Transformers: {speedup:.1f}x, "
        f"{'meets' if speedup >= SPEEDUP_TARGET else 'misses'}; zstack's peak per rank <= "
        f"{MEMORY_TARGET:g}x the fp32 model: {worst:.2f}x (worst round and rank), "
        f"{'meets' if worst <= MEMORY_TARGET else 'misses'}."
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(*sys.argv[2:4])
    else:
        main()
