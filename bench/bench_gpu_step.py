"""A ZeRO-3 training step on one GPU (#27): zengine against FSDP2 and DeepSpeed ZeRO-3 at world
size 1, on a Llama-shaped model that fills most of the card; then `offload_states` of the same
engines.

Run by ``nox -s bench -- gpu_step`` on a CUDA machine, or ``python bench/bench_gpu_step.py
[--layers N] [--steps N] [CONTENDER ...]`` (bench/gpu_check.sh runs it so); prints markdown.
Without CUDA it measures nothing and says so; ``--device cpu`` runs a tiny shape on CPU over
gloo, to check the script itself off a GPU.

The model (``Llama`` below): token embedding, `layers` decoder layers (RMSNorm, attention through
four bias-free projections and ``F.scaled_dot_product_attention``, causal, no rotary embedding;
RMSNorm, a SwiGLU MLP), a final RMSNorm and an untied head. Default on CUDA: hidden 4096, 32
heads, intermediate 11008, vocabulary 32000, 12 layers (2.7 B parameters), sequence 2048,
micro-batch 4. Every layer runs under ``torch.utils.checkpoint`` (non-reentrant). bf16 compute,
fp32 master weights and AdamW (lr 1e-5) for all three:

- zengine: ``zengine.initialize`` with ``bf16`` and ``zero_optimization.stage`` 3, DeepSpeed's
  default thresholds, the optimizer ``AdamW`` from the config (torch's fused kernel).
- FSDP2: ``fully_shard`` per layer, then the root, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, ``torch.optim.AdamW(fused=True)``.
- DeepSpeed: ``deepspeed.initialize`` with the same config as zengine: its FusedAdam, compiled
  with nvcc on first use (the set-up column holds that time), which its ``offload_states``
  requires. Where it cannot be compiled, ``torch.optim.AdamW(fused=True)`` passed in
  (``zero_allow_untested_optimizer``), and no ``offload_states``; also so on CPU.

Each contender runs alone in a fresh process (world size 1, NCCL on CUDA): 3 warm-up steps, then
`steps` timed steps (each ended by a device synchronize; the median is reported), then 2 steps
under cProfile: the framework's own Python time per step (self time of the functions in its
files: torch.distributed's for all three, with zpartition, zengine and zcomm, or deepspeed) is
the cost of its hooks and bookkeeping, as a share of the profiled step (cProfile slows Python
code, so the share is an upper bound). Peak memory is ``torch.cuda.max_memory_allocated`` over
the timed steps. Then, for zengine and DeepSpeed, two cycles of ``offload_states()`` /
``reload_states()`` to pinned host memory: the seconds each takes, and the device memory freed
against what was allocated before (the state, as nothing else is held between steps).

DeepSpeed must be the real one: the worker refuses the compatibility ``deepspeed``.
``ZSTACK_DEEPSPEED_PATH``, when set, is put first on DeepSpeed's worker's path (where the
device machine keeps a DeepSpeed installed beside zstack's sources).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from _common import Batch, Step, engine_step, free_port, rank_env, trainer_step

ZENGINE, FSDP2, DEEPSPEED = "zengine", "FSDP2", "DeepSpeed"
CONTENDERS = (ZENGINE, FSDP2, DEEPSPEED)
LR = 1e-5
WARMUP, PROFILED, OFFLOAD_CYCLES = 3, 2, 2
# The files whose Python self time counts as each framework's hooks and bookkeeping.
# torch.distributed's Python (c10d's wrappers, FSDP2, DTensor) counts for all three.
FRAMEWORK_FILES = {
    ZENGINE: ("/torch/distributed/", "/zpartition/", "/zengine/", "/zcomm/"),
    FSDP2: ("/torch/distributed/",),
    DEEPSPEED: ("/torch/distributed/", "/deepspeed/"),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    seq: int
    micro: int

    def argv(self) -> list[str]:
        return [str(v) for v in dataclasses.astuple(self)]

    def parameters(self) -> int:
        layer = 4 * self.hidden**2 + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden


CUDA_SHAPE = Shape(
    layers=12, hidden=4096, heads=32, intermediate=11008, vocab=32000, seq=2048, micro=4
)
CPU_SHAPE = Shape(layers=2, hidden=64, heads=4, intermediate=172, vocab=256, seq=32, micro=2)


class DecoderLayer(nn.Module):
    """A Llama decoder layer without the rotary embedding (its cost is small, and equal for all)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        h = shape.hidden
        self.heads = shape.heads
        self.attn_norm = nn.RMSNorm(h)
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, h, bias=False)
        self.v = nn.Linear(h, h, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h)
        self.gate = nn.Linear(h, shape.intermediate, bias=False)
        self.up = nn.Linear(h, shape.intermediate, bias=False)
        self.down = nn.Linear(shape.intermediate, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        y = self.attn_norm(x)
        q, k, v = (
            p(y).view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for p in (self.q, self.k, self.v)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, c))
        y = self.mlp_norm(x)
        out: torch.Tensor = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return out


class Llama(nn.Module):
    """Embedding, decoder layers (each under activation checkpointing), norm, head; forward
    returns the mean cross-entropy, computed in fp32."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        logits = self.head(self.norm(x)).float()
        loss: torch.Tensor = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss


# -- one contender, in its own process --------------------------------------------------------


def _engine_config(shape: Shape, device: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": shape.micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "bf16": {"enabled": device == "cuda"},
        "zero_optimization": {"stage": 3},
    }


def _model(shape: Shape, device: str) -> Llama:
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: 2.7 B parameters initialize in seconds
        return Llama(shape)


def _deepspeed(shape: Shape, device: str, config: dict[str, Any]) -> tuple[Step, Any]:
    import deepspeed  # type: ignore[import-not-found,unused-ignore]

    if "zstack" in deepspeed.__version__:
        found = deepspeed.__version__
        raise SystemExit(f"the DeepSpeed contender found zstack's compatibility ({found})")
    if device == "cuda":  # its FusedAdam, which its offload_states requires (compiled here)
        model = _model(shape, device)
        optimizer = {"type": "AdamW", "params": {"lr": LR}}
        try:
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=model.parameters(),
                config=config | {"optimizer": optimizer},
            )
            return engine_step(engine), engine
        except Exception as error:  # no nvcc or ninja to compile it: torch's AdamW, below
            print(f"DeepSpeed's FusedAdam failed ({error!r}); torch's AdamW", file=sys.stderr)
            del model
    # its CPU Adam would be compiled first; its offload_states takes only its FusedAdam
    model = _model(shape, device)
    adamw = torch.optim.AdamW(model.parameters(), lr=LR, fused=device == "cuda")
    config = config | {"zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw, config=config)
    return engine_step(engine), None


def _build(label: str, shape: Shape, device: str) -> tuple[Step, Any]:
    """The step function of `label`, and its engine (None for FSDP2)."""
    config = _engine_config(shape, device)
    if label == DEEPSPEED:
        return _deepspeed(shape, device, config)
    model = _model(shape, device)
    if label == ZENGINE:
        import zengine

        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR}}
        engine, *_ = zengine.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        return engine_step(engine), engine
    if label == FSDP2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if device == "cuda" else None, reduce_dtype=torch.float32
        )
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=device == "cuda")
        return trainer_step(model, optimizer), None
    raise ValueError(f"unknown contender {label!r}")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _framework_seconds(profile: cProfile.Profile, files: tuple[str, ...]) -> float:
    """Self time of the functions defined in `files` (path fragments)."""
    stats: Any = pstats.Stats(profile)
    # stats.stats: {(file, line, name): (calls, primitive calls, self time, cumulative, callers)}
    return float(
        sum(v[2] for (file, _, _), v in stats.stats.items() if any(f in file for f in files))
    )


def _offload_cycles(engine: Any) -> list[dict[str, float]]:
    cycles = []
    for _ in range(OFFLOAD_CYCLES):
        before = torch.cuda.memory_allocated()
        offload = _timed(engine.offload_states, "cuda")
        after = torch.cuda.memory_allocated()
        reload = _timed(engine.reload_states, "cuda")
        cycles.append(
            {
                "before_gib": before / 2**30,
                "freed_share": (before - after) / before if before else 0.0,
                "offload_s": offload,
                "reload_s": reload,
                "back_gib": torch.cuda.memory_allocated() / 2**30,
            }
        )
    return cycles


def worker(label: str, shape: Shape, device: str, steps: int) -> None:
    began = time.perf_counter()
    step, engine = _build(label, shape, device)
    built = time.perf_counter() - began
    generator = torch.Generator().manual_seed(1)

    def tokens() -> torch.Tensor:
        shape_ = (shape.micro, shape.seq)
        return torch.randint(0, shape.vocab, shape_, generator=generator).to(device)

    batches: list[Batch] = [(tokens(), tokens()) for _ in range(2)]
    losses = [float(step(batches[i % 2])) for i in range(WARMUP)]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def timed_step(batch: Batch) -> float:
        return _timed(lambda: losses.append(float(step(batch))), device)

    times = [timed_step(batches[i % 2]) for i in range(steps)]
    profile = cProfile.Profile()
    _sync(device)
    start = time.perf_counter()
    profile.enable()
    for i in range(PROFILED):
        step(batches[i % 2])
    _sync(device)
    profile.disable()
    profiled = (time.perf_counter() - start) / PROFILED
    result: dict[str, Any] = {
        "label": label,
        "build_s": built,
        "step_s": statistics.median(times),
        "losses": losses,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
        "framework_s": _framework_seconds(profile, FRAMEWORK_FILES[label]) / PROFILED,
        "profiled_step_s": profiled,
        # on CPU there is no device memory to give back
        "offload": _offload_cycles(engine) if engine is not None and device == "cuda" else [],
    }
    print("RESULT " + json.dumps(result), flush=True)


# -- the driver -------------------------------------------------------------------------------


def _run(label: str, shape: Shape, device: str, steps: int, logdir: Path) -> dict[str, Any]:
    """One contender in a fresh process of world size 1; its RESULT, or why it failed."""
    env = rank_env(0, 1, free_port())
    deepspeed_path = os.environ.get("ZSTACK_DEEPSPEED_PATH")
    if label == DEEPSPEED and deepspeed_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [deepspeed_path, env.get("PYTHONPATH")]))
    log = logdir / f"{label}.log"
    command = [sys.executable, __file__, "--worker", label, device, str(steps), *shape.argv()]
    print(f"{label}: running (log {log})", file=sys.stderr, flush=True)
    with log.open("w") as err:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
            return result
    tail = log.read_text().splitlines()[-12:]
    return {"label": label, "failed": f"exit code {done.returncode}", "tail": tail}


def _print(results: list[dict[str, Any]], shape: Shape, device: str, steps: int) -> None:
    print(
        f"## ZeRO-3 step at world size 1 on {_device_name(device)}: Llama-shaped, {shape.layers} "
        f"layers, hidden {shape.hidden}, intermediate {shape.intermediate}, vocab {shape.vocab} "
        f"({shape.parameters() / 1e6:,.0f} M parameters), sequence {shape.seq}, micro-batch "
        f"{shape.micro}, activation checkpointing per layer, {_dtype(device)}; "
        f"torch {torch.__version__}; median of {steps} steps\n"
    )
    ok = [r for r in results if "failed" not in r]
    zengine = next((r for r in ok if r["label"] == ZENGINE), None)
    _header(
        "contender",
        "step (s)",
        "vs zengine",
        "peak memory (GiB)",
        "framework Python per step (ms)",
        "share of the profiled step",
        "set-up (s)",
        "losses",
    )
    for r in ok:
        ratio = f"{r['step_s'] / zengine['step_s']:.3f}x" if zengine else "-"
        share = r["framework_s"] / r["profiled_step_s"]
        losses = ", ".join(f"{x:.4f}" for x in r["losses"][:3])
        print(
            f"| {r['label']} | {r['step_s']:.3f} | {ratio} | {r['peak_gib']:.1f} | "
            f"{r['framework_s'] * 1e3:.1f} | {share:.1%} | {r['build_s']:.1f} | {losses} |"
        )
    offloads = [r for r in ok if r["offload"]]
    if offloads:
        print("\n`offload_states()` / `reload_states()` to pinned host memory, two cycles:\n")
        _header(
            "contender",
            "cycle",
            "allocated before (GiB)",
            "freed",
            "offload (s)",
            "reload (s)",
            "GB/s out, in",
            "allocated after reload (GiB)",
        )
        for r in offloads:
            for n, c in enumerate(r["offload"], 1):
                moved = c["before_gib"] * c["freed_share"] * 2**30 / 1e9
                rates = f"{moved / c['offload_s']:.1f}, {moved / c['reload_s']:.1f}"
                print(
                    f"| {r['label']} | {n} | {c['before_gib']:.2f} | {c['freed_share']:.2%} | "
                    f"{c['offload_s']:.2f} | {c['reload_s']:.2f} | {rates} | {c['back_gib']:.2f} |"
                )
    for r in results:
        if "failed" in r:
            print(f"\n{r['label']} failed ({r['failed']}):\n```\n" + "\n".join(r["tail"]) + "\n```")


def _header(*names: str) -> None:
    print("| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))


def _dtype(device: str) -> str:
    return "bf16" if device == "cuda" else "fp32"


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, help="decoder layers (12 on CUDA)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per contender")
    parser.add_argument("--logs", type=Path, default=Path("bench_gpu_step_logs"))
    parser.add_argument("contenders", nargs="*", help=f"some of {', '.join(CONTENDERS)} (all)")
    args = parser.parse_args()
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}: choose from {list(CONTENDERS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_step: no CUDA device, nothing measured (--device cpu checks the script)")
        return
    shape = CUDA_SHAPE if args.device == "cuda" else CPU_SHAPE
    if args.layers:
        shape = dataclasses.replace(shape, layers=args.layers)
    args.logs.mkdir(parents=True, exist_ok=True)
    chosen = args.contenders or list(CONTENDERS)
    results = [_run(label, shape, args.device, args.steps, args.logs) for label in chosen]
    _print(results, shape, args.device, args.steps)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        at = sys.argv.index("--worker")
        label, device, steps, *dims = sys.argv[at + 1 :]
        worker(label, Shape(*map(int, dims)), device, int(steps))
    else:
        main()
