"""Beyond memory: ZeRO-Infinity at world size 1 on a Llama-shaped model whose training state is
1.5x the machine's memory, against the disk's speed and the compute measured in the same run.

Run by ``nox -s bench -- infinity`` (or ``python bench/bench_infinity.py``); prints markdown.

The model is a Transformers ``LlamaForCausalLM`` built from a ``LlamaConfig`` (nothing is
downloaded) under ``zengine.zero.Init``, trained with ZeRO-3, bf16, ``offload_param`` and
``offload_optimizer`` on NVMe and activation checkpointing (Transformers' non-reentrant
``gradient_checkpointing``). Its size comes from ``/proc/meminfo``: training state (bf16
parameters and gradients, fp32 masters and two Adam moments: 16 bytes a parameter) at least
``--factor`` (1.5) times ``MemTotal``. The files go under ``ZOFFLOAD_BENCH_DIR`` (default:
``/work/scratch/nvme-bench``, else a temporary directory), into a folder of their own that is
deleted afterwards; the benchmark refuses, with the numbers, when that disk lacks room.
``--scale N`` sizes the model for ``MemTotal / N`` (``--quick``: N = 64, a minute or two).

Measured in the same run, each part in a fresh process:

- ``dd``'s write (``oflag=direct conv=fsync``) and read (``iflag=direct``) bandwidth in the
  folder, before and after the training run (medians);
- the bytes a step moves through the disk: zoffload's own accounting (`zoffload.nvme_stats`);
  the disk bound is the time ``dd`` takes for them: written / dd write + read / dd read;
- the step's compute time with the state in memory: the same model's hidden size with 1 and 4
  layers, no offload (ZeRO-3, bf16, checkpointing), median step; per layer = the difference / 3,
  scaled by the layer count, plus the rest (embeddings, head, the step's fixed cost);
- the step time of the offloaded model (median of the steps after the first), its ratio to
  max(disk bound, compute), the process's peak RSS (``VmHWM``) and the time from building
  the model to the end of the first step;
- with ``--quick`` (any scale but 1) the whole model with its state in memory too: the
  measured compute beside the scaled one, and whether the losses are the same, step by step;
- DeepSpeed's ZeRO-Infinity on the same model and config (its ``async_io`` op, CPU
  accelerator), with the interpreter given by ``--deepspeed-python`` (default: this one),
  or the error it stops with.

Targets (issue #41): step <= 1.15x max(disk bound, compute); peak RSS <= a quarter of memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GB = 1e9
GIB = 1 << 30
STATE_BYTES = 16  # a parameter's training state: bf16 value and gradient, fp32 master, m, v
DISK_BYTES = 14  # of which on disk: the bf16 shard and the fp32 master, m and v
DEFAULT_DIR = Path("/work/scratch/nvme-bench")
# The compute is measured on 1 and SPAN layers: per layer = the difference / (SPAN - 1). One
# layer's step time on the small models is within the machine's noise; four are not.
SPAN = 4


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped model: ``layers`` decoder layers of ``hidden``, a vocabulary, a batch."""

    hidden: int
    intermediate: int
    heads: int
    layers: int
    vocab: int
    seq: int = 128
    micro: int = 1

    @property
    def per_layer(self) -> int:
        """Parameters in one decoder layer (attention without bias, SwiGLU MLP, 2 norms)."""
        return 4 * self.hidden**2 + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        """All parameters: the layers, input embeddings, untied head, final norm."""
        return self.layers * self.per_layer + 2 * self.vocab * self.hidden + self.hidden

    def with_layers(self, layers: int) -> Shape:
        return Shape(self.hidden, self.intermediate, self.heads, layers, self.vocab, self.seq)


def mem_total() -> int:
    """``MemTotal`` of ``/proc/meminfo``, bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no MemTotal in /proc/meminfo: cannot size the model")


def size_model(memory: int, factor: float) -> Shape:
    """The smallest model of the family whose training state is at least ``factor x memory``:
    Llama-2-like widths (head size 128, MLP 8/3 of the width, rounded to 256)."""
    params = factor * memory / STATE_BYTES
    hidden, vocab = (
        (2560, 32000) if params >= 1e9 else (1024, 32000) if params >= 2e8 else (512, 8192)
    )
    intermediate = math.ceil(8 * hidden / 3 / 256) * 256
    shape = Shape(hidden, intermediate, hidden // 128, 1, vocab)
    rest = shape.params - shape.per_layer
    layers = max(2, math.ceil((params - rest) / shape.per_layer))
    return shape.with_layers(layers)


# -- the workers (each a fresh process; one JSON line after ``RESULT``) ------------------------


def _kernel_io() -> tuple[int, int]:
    """The bytes this process (all its threads) read from and wrote to storage, as the kernel
    counts them (``/proc/self/io``; O_DIRECT included, page-cache hits not)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _zero_config(offload: bool, folder: str, tile: int) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "sub_group_size": tile,
        "stage3_prefetch_bucket_size": tile,
        "stage3_max_live_parameters": tile,
        "stage3_max_reuse_distance": tile,
        "stage3_param_persistence_threshold": 10_000,
    }
    if offload:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": folder}
        zero["offload_param"] = {"device": "nvme", "nvme_path": folder}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def _llama(shape: Shape) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=shape.seq,
        tie_word_embeddings=False,
        use_cache=False,
    )


def _checkpointing(model: Any) -> None:
    """Transformers' activation checkpointing, non-reentrant (named ``gradient_checkpointing``
    before Transformers 5.2x and in DeepSpeed's environment)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _batches(shape: Shape, steps: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, shape.vocab, (shape.micro, shape.seq), generator=g) for _ in range(steps)
    ]


def worker_zstack(
    shape: Shape, offload: bool, folder: str, steps: int, tile: int
) -> dict[str, Any]:
    """Train ``steps`` steps with zengine; step times, disk bytes per step, losses, peak RSS."""
    import torch
    from transformers import LlamaForCausalLM

    import zengine
    import zoffload

    torch.manual_seed(0)
    config = _zero_config(offload, folder, tile)
    batches = _batches(shape, steps)
    began = time.perf_counter()
    with zengine.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(_llama(shape))
    _checkpointing(model)
    engine, *_ = zengine.initialize(model=model, config=config)
    built = time.perf_counter() - began
    times, losses, written, read, io_w, io_r, k_w, k_r = [], [], [], [], [], [], [], []
    first = 0.0
    for i, ids in enumerate(batches):
        before, k_before = zoffload.nvme_stats(), _kernel_io()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        now = time.perf_counter()
        moved, k_after = zoffload.nvme_stats() - before, _kernel_io()
        k_r.append(k_after[0] - k_before[0])
        k_w.append(k_after[1] - k_before[1])
        if i == 0:
            first = now - began
        times.append(now - start)
        losses.append(loss.item())
        written.append(moved.bytes_written)
        read.append(moved.bytes_read)
        io_w.append(moved.write_seconds)
        io_r.append(moved.read_seconds)
    return {
        "times": times,
        "losses": losses,
        "written": written,
        "read": read,
        "kernel_written": k_w,
        "kernel_read": k_r,
        "write_seconds": io_w,
        "read_seconds": io_r,
        "first_step": first,
        "built": built,
        "peak_rss": _peak_rss(),
    }


def worker_deepspeed(shape: Shape, folder: str, steps: int, tile: int) -> dict[str, Any]:
    """The same model and config on DeepSpeed's ZeRO-Infinity (real DeepSpeed only)."""
    import torch
    from transformers import LlamaForCausalLM

    import deepspeed

    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as error:
        raise RuntimeError(f"not DeepSpeed (zstack's compatibility package?): {error}") from error
    aio = AsyncIOBuilder()
    if not aio.is_compatible(verbose=False):
        raise RuntimeError("DeepSpeed's async_io op is not compatible here (ds_report: libaio?)")
    torch.manual_seed(0)
    config = _zero_config(True, folder, tile)
    config["aio"] = {"block_size": 8 << 20, "queue_depth": 8, "thread_count": 1}
    batches = _batches(shape, steps)
    began = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(_llama(shape))
    _checkpointing(model)
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )
    times, losses = [], []
    first = 0.0
    for i, ids in enumerate(batches):
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        now = time.perf_counter()
        if i == 0:
            first = now - began
        times.append(now - start)
        losses.append(loss.item())
    return {"times": times, "losses": losses, "first_step": first, "peak_rss": _peak_rss()}


def _worker_main(argv: list[str]) -> None:
    kind, payload = argv[0], json.loads(argv[1])
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    shape = Shape(**payload["shape"])
    if kind == "zstack":
        result = worker_zstack(
            shape, payload["offload"], payload["folder"], payload["steps"], payload["tile"]
        )
    else:
        result = worker_deepspeed(shape, payload["folder"], payload["steps"], payload["tile"])
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver ------------------------------------------------------------------------------


@dataclass
class Run:
    """A worker's outcome: its result, or why it has none."""

    result: dict[str, Any] | None
    error: str | None = None


def _launch(python: str, kind: str, payload: dict[str, Any], timeout: float) -> Run:
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_free_port()))
    cmd = [python, __file__, "--worker", kind, json.dumps(payload)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Run(None, f"no result within {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return Run(json.loads(line.removeprefix("RESULT ")))
    lines = [s for s in (proc.stderr + proc.stdout).splitlines() if s.strip()]
    errors = [s for s in lines if "Error" in s or "error:" in s]
    why = errors[-1] if errors else (lines[-1] if lines else "no output")
    return Run(None, f"exit code {proc.returncode}: {why.strip()[:400]}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _dd(folder: Path, nbytes: int, reps: int) -> tuple[list[float], list[float]]:
    """GB/s of ``reps`` direct writes of a new file of ``nbytes`` and of reads of it."""
    path = folder / "dd.bin"
    count = max(1, nbytes // (8 << 20))
    writes, reads = [], []
    for _ in range(reps):
        path.unlink(missing_ok=True)  # outside dd's time: freeing blocks waits for discard
        start = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={count}", "oflag=direct",
             "conv=fsync", "status=none"],
            check=True,
        )  # fmt: skip
        writes.append(count * (8 << 20) / (time.perf_counter() - start) / GB)
        start = time.perf_counter()
        subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct", "status=none"],
            check=True,
        )
        reads.append(count * (8 << 20) / (time.perf_counter() - start) / GB)
    path.unlink(missing_ok=True)
    return writes, reads


def _root() -> Path:
    given = os.environ.get("ZOFFLOAD_BENCH_DIR")
    if given:
        return Path(given)
    return DEFAULT_DIR if DEFAULT_DIR.parent.is_dir() else Path(tempfile.gettempdir())


def _check_room(root: Path, shape: Shape, dd_bytes: int) -> None:
    """Refuse, with the numbers, when the disk cannot hold the swap files (the shards and
    the masters and moments, a quarter more for files being replaced) and dd's file."""
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    needed = int(shape.params * DISK_BYTES * 1.25) + dd_bytes
    if needed > free:
        raise SystemExit(
            f"bench infinity: {shape.params / 1e9:.2f} B parameters need about "
            f"{needed / GB:.1f} GB of disk under {root} ({DISK_BYTES} bytes a parameter in swap "
            f"files, a quarter more while files are replaced, {dd_bytes / GB:.1f} GB for dd); "
            f"{free / GB:.1f} GB are free. Point ZOFFLOAD_BENCH_DIR at a larger disk, or try "
            "--quick."
        )


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="size for MemTotal / 64")
    parser.add_argument("--scale", type=int, default=1, help="size for MemTotal / SCALE")
    parser.add_argument("--factor", type=float, default=1.5, help="state / memory (1.5)")
    parser.add_argument("--steps", type=int, default=0, help="steps (default: 3, quick: 6)")
    parser.add_argument("--deepspeed-python", default=sys.executable)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--deepspeed-only", action="store_true", help="only DeepSpeed's run")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per worker, seconds")
    args = parser.parse_args(argv)
    scale = 64 if args.quick and args.scale == 1 else args.scale
    steps = args.steps or (3 if scale == 1 else 6)
    memory = mem_total()
    shape = size_model(memory // scale, args.factor)
    dd_bytes = 2 * GIB if scale == 1 else 512 << 20
    root = _root()
    _check_room(root, shape, dd_bytes)
    folder = Path(tempfile.mkdtemp(prefix="bench-infinity-", dir=root))
    try:
        report(shape, memory, scale, steps, folder, dd_bytes, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def report(
    shape: Shape,
    memory: int,
    scale: int,
    steps: int,
    folder: Path,
    dd_bytes: int,
    args: argparse.Namespace,
) -> None:
    python = sys.executable
    timeout = args.timeout
    tile = tile_of(shape)
    if args.deepspeed_only:
        ds: Run | None = _launch(
            args.deepspeed_python, "deepspeed", _payload(shape, True, folder, steps, tile), timeout
        )
        _deepspeed_line(ds)
        return
    ddw, ddr = _dd(folder, dd_bytes, 3)
    small = [
        _launch(
            python, "zstack", _payload(shape.with_layers(n), False, folder, steps, tile), timeout
        )
        for n in (1, SPAN)
    ]
    whole_in_memory = None
    if scale != 1:  # it fits: the compute measured whole, and the losses to compare
        whole_in_memory = _launch(
            python, "zstack", _payload(shape, False, folder, steps, tile), timeout
        )
    infinity = _launch(python, "zstack", _payload(shape, True, folder, steps, tile), timeout)
    w2, r2 = _dd(folder, dd_bytes, 3)
    ddw, ddr = ddw + w2, ddr + r2
    ds = None
    if not args.no_deepspeed:
        ds = _launch(
            args.deepspeed_python, "deepspeed", _payload(shape, True, folder, steps, tile), timeout
        )

    print("## ZeRO-Infinity beyond memory (world size 1)\n")
    print(
        f"MemTotal {memory / GIB:.1f} GiB{'' if scale == 1 else f', sized for 1/{scale} of it'}; "
        f"Llama-shaped: {shape.layers} layers, hidden {shape.hidden}, MLP {shape.intermediate}, "
        f"{shape.heads} heads, vocabulary {shape.vocab}, sequence {shape.seq}, micro-batch "
        f"{shape.micro}; bf16, ZeRO-3, offload_param + offload_optimizer nvme, activation "
        f"checkpointing; {steps} steps (times: median after the first); disk: {folder.parent}\n"
    )
    for name, run in [("1 layer", small[0]), (f"{SPAN} layers", small[1]), ("offloaded", infinity)]:
        if run.result is None:
            print(f"**{name} run failed**: {run.error}\n")
    one, two, res = small[0].result, small[1].result, infinity.result
    if one is None or two is None or res is None:
        _deepspeed_line(ds)
        return
    t1 = _median(one["times"][1:])
    t2 = _median(two["times"][1:])
    per_layer = (t2 - t1) / (SPAN - 1)
    compute = t1 + per_layer * (shape.layers - 1)
    step = _median(res["times"][1:])
    wr, rd = _median(res["written"][1:]), _median(res["read"][1:])
    kw, kr = _median(res["kernel_written"][1:]), _median(res["kernel_read"][1:])
    dw, dr = _median(ddw), _median(ddr)
    # The kernel's count where it is larger: bytes that did not go through zoffload's files
    # (an engine's own swap files) take the disk's time too.
    disk = max(wr, kw) / (dw * GB) + max(rd, kr) / (dr * GB)
    bound = max(disk, compute)
    state = shape.params * STATE_BYTES
    rows = [
        ("parameters", f"{shape.params / 1e9:.3f} B ({shape.params:,})"),
        (
            "training state (16 B/param) vs memory",
            f"{state / GB:.1f} GB = {state / memory:.2f}x MemTotal"
            + ("" if scale == 1 else f" ({state / (memory / scale):.2f}x MemTotal/{scale})"),
        ),
        (
            "bytes per step through the disk (zoffload)",
            f"{wr / GB:.2f} GB written, {rd / GB:.2f} GB read",
        ),
        (
            "bytes per step, the kernel's count for the process (/proc/self/io)",
            f"{kw / GB:.2f} GB written, {kr / GB:.2f} GB read",
        ),
        ("dd write / read (direct, median of 6)", f"{dw:.2f} / {dr:.2f} GB/s"),
        ("disk bound (the larger counts: written / dd write + read / dd read)", f"{disk:.2f} s"),
        (
            "time inside zoffload's writes / reads per step (overlapping calls add up)",
            f"{_median(res['write_seconds'][1:]):.2f} / {_median(res['read_seconds'][1:]):.2f} s",
        ),
        (
            "compute, state in memory (1 layer + per layer x (L-1))",
            f"{compute:.2f} s ({t1:.2f} + {per_layer:.3f} x {shape.layers - 1})",
        ),
    ]
    if whole_in_memory is not None and whole_in_memory.result is not None:
        whole = whole_in_memory.result
        same = whole["losses"] == res["losses"]
        rows.append(
            ("compute, whole model in memory (measured)", f"{_median(whole['times'][1:]):.2f} s")
        )
        rows.append(
            (
                "losses offloaded == in memory, every step",
                "yes" if same else f"no: {res['losses']} vs {whole['losses']}",
            )
        )
    rows += [
        ("step time (median)", f"{step:.2f} s"),
        ("step / max(disk bound, compute) (target <= 1.15)", f"{step / bound:.2f}"),
        (
            "peak RSS (target <= 1/4 of memory)",
            f"{res['peak_rss'] / GIB:.2f} GiB = {res['peak_rss'] / memory:.1%} of MemTotal",
        ),
        (
            "time to first step (build, initialize, step 1)",
            f"{res['first_step']:.1f} s (built in {res['built']:.1f} s)",
        ),
        ("losses", " ".join(f"{x:.4f}" for x in res["losses"])),
    ]
    print("| | |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(
        f"\nEach step (s): {' '.join(f'{t:.2f}' for t in res['times'])}; dd write "
        f"{' '.join(f'{x:.2f}' for x in ddw)}, read {' '.join(f'{x:.2f}' for x in ddr)} GB/s\n"
    )
    _deepspeed_line(ds)


def _deepspeed_line(ds: Run | None) -> None:
    if ds is None:
        return
    if ds.result is None:
        print(f"DeepSpeed ZeRO-Infinity, same model and config: did not run: {ds.error}\n")
        return
    r = ds.result
    print(
        f"DeepSpeed ZeRO-Infinity, same model and config: step {_median(r['times'][1:]):.2f} s "
        f"(median after the first), first step after {r['first_step']:.1f} s, peak RSS "
        f"{r['peak_rss'] / GIB:.2f} GiB, losses {' '.join(f'{x:.4f}' for x in r['losses'])}\n"
    )


def tile_of(shape: Shape) -> int:
    """The optimizer's tile (``sub_group_size``) and the parameters read ahead and kept live:
    about a 24th of the model, so that host memory holds a few tiles, not the model."""
    return max(1 << 20, shape.params // 24)


def _payload(shape: Shape, offload: bool, folder: Path, steps: int, tile: int) -> dict[str, Any]:
    return {
        "shape": asdict(shape),
        "offload": offload,
        "folder": str(folder),
        "steps": steps,
        "tile": tile,
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2:])
    else:
        main()
