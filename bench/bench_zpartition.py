"""zpartition (ZeRO-3 parameters) against plain PyTorch and FSDP2 on CPU; prints markdown tables.

Run by ``nox -s bench -- zpartition`` (or ``python bench/bench_zpartition.py [--quick]``).

The model is a small GPT: token embedding (vocab 256) + learned position embedding, 48 blocks of
hidden 64 (LayerNorm, causal 4-head attention through one qkv Linear, proj Linear, residual;
LayerNorm, Linear 64->256, GELU, Linear 256->64, residual), a final LayerNorm and a Linear head;
sequence 64, micro-batch 4, cross-entropy on random targets. Each step is forward, backward,
``torch.optim.Adam(lr=1e-3).step()`` and ``zero_grad()``: Adam's default implementation, which
for CPU tensors is its per-tensor loop (torch picks foreach only on CUDA). Every contender
starts from the same seed and sees the same batches. Tensors are tiny, so the step is dominated
by per-module Python work: the hooks a ZeRO-3 implementation adds are what this measures. One
torch thread per process throughout (two ranks share the 2-core machine).

1. World size 1, in one process: plain PyTorch; zpartition with persistence threshold 0 (every
   parameter partitioned and gathered per module), the same with each Block a leaf module
   (gathered as one unit, like FSDP2 per block), and zpartition's default config (threshold
   1e5: every parameter of this model stays gathered); FSDP2 ``fully_shard`` per block then the
   root, with Adam's default and with fused Adam. Medians of wall and CPU time per step over
   rounds in rotating order, and the median per-round ratio against plain (an A/A row times
   plain against itself, which shows how far the harness moves on its own).
2. Python function calls per step (cProfile), a count that machine load does not move: at world
   size 1, and on rank 0 at world size 2 (at world size 1 zpartition's gathers take a direct
   path, so only world size 2 shows the whole of its per-module work).
3. World size 2 (two gloo processes, micro-batch 4 each): zpartition against FSDP2.
4. A correctness check: the losses of the first steps against plain PyTorch (at world size 2,
   against plain PyTorch on the whole global batch of 8).
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import zcomm
import zpartition
from _common import GPT, Batch, Block, Step, run_ranks, trainer_step

VOCAB, HIDDEN, SEQ, HEADS, BLOCKS, MICRO_BATCH = 256, 64, 64, 4, 48, 4
LR = 1e-3
MODEL_SEED, DATA_SEED, N_BATCHES = 0, 1, 4  # N_BATCHES distinct batches, used in turn
WORLD = 2
QUICK = "--quick" in sys.argv
# rounds of the rotation, steps per contender per round (world size 1, 2), warm-up steps,
# profiled steps, steps whose loss is checked
ROUNDS, STEPS, STEPS_WS2, WARMUP, PROFILED, CHECKED = (
    (2, 2, 2, 1, 1, 3) if QUICK else (5, 10, 8, 3, 3, 5)
)
TARGET_WS1, TARGET_WS2 = 1.2, 1.0  # zpartition / plain at ws 1; zpartition / FSDP2 at ws 2
TARGET_CALLS_PLAIN, TARGET_CALLS_ZPARTITION = 19_500, 100_000

PLAIN, AA = "plain PyTorch", "plain PyTorch (A/A copy)"
ZP0 = "zpartition, threshold 0"
ZP0_LEAF = "zpartition, threshold 0, Block leaves"
ZP_DEFAULT = "zpartition, default config (threshold 1e5: all persist)"
FSDP, FSDP_FUSED = "FSDP2 per block", "FSDP2 per block, fused Adam"


def _batches(global_batch: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(DATA_SEED)
    return [
        (
            torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen),
            torch.randint(0, VOCAB, (global_batch, SEQ), generator=gen),
        )
        for _ in range(N_BATCHES)
    ]


def _model() -> GPT:
    torch.manual_seed(MODEL_SEED)
    return GPT(vocab=VOCAB, hidden=HIDDEN, seq=SEQ, heads=HEADS, blocks=BLOCKS)


def _plain() -> Step:
    model = _model()
    return trainer_step(model, torch.optim.Adam(model.parameters(), lr=LR))


def _zpartition(threshold: int | None, leaves: bool) -> Step:
    model = _model()
    if leaves:
        zpartition.set_z3_leaf_modules(model, [Block])
    config = (
        zpartition.ZeroParamConfig()
        if threshold is None
        else zpartition.ZeroParamConfig(param_persistence_threshold=threshold)
    )
    handle = zpartition.partition(model, config=config)
    return trainer_step(model, torch.optim.Adam(handle.shard_parameters(), lr=LR))


def _fsdp(fused: bool) -> Step:
    model = _model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, fused=True if fused else None)
    return trainer_step(model, optimizer)


BUILDERS: dict[str, Callable[[], Step]] = {
    PLAIN: _plain,
    AA: _plain,
    ZP0: lambda: _zpartition(0, leaves=False),
    ZP0_LEAF: lambda: _zpartition(0, leaves=True),
    ZP_DEFAULT: lambda: _zpartition(None, leaves=False),
    FSDP: lambda: _fsdp(fused=False),
    FSDP_FUSED: lambda: _fsdp(fused=True),
}
WS2_CONTENDERS = [FSDP, ZP0, ZP0_LEAF]  # the first is the reference of the paired ratios


@dataclass
class Contender:
    """A built trainer, the batches it cycles through, and how many steps it has taken."""

    label: str
    step: Step
    batches: list[Batch]
    done: int = 0

    def run(self, steps: int) -> torch.Tensor:
        loss = torch.zeros(())
        for _ in range(steps):
            loss = self.step(self.batches[self.done % len(self.batches)])
            self.done += 1
        return loss


def _build(labels: list[str], batches: list[Batch]) -> tuple[list[Contender], dict[str, str]]:
    """The contenders that build, and for the others the reason they could not."""
    built, failed = [], {}
    for label in labels:
        try:
            built.append(Contender(label, BUILDERS[label](), batches))
        except Exception as exc:  # one broken contender must not hide the others' figures
            failed[label] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    return built, failed


def _rotate(
    contenders: list[Contender], steps: int, barrier: bool
) -> dict[str, dict[str, list[float]]]:
    """Per contender, seconds of wall and CPU time per step in each round; contenders take
    turns, the order rotating every round, so each round's figures share the machine's load."""
    for c in contenders:
        c.run(WARMUP)
    times: dict[str, dict[str, list[float]]] = {
        c.label: {"wall": [], "cpu": []} for c in contenders
    }
    for i in range(ROUNDS):
        for k in range(len(contenders)):
            c = contenders[(i + k) % len(contenders)]
            if barrier:
                dist.barrier()  # start together: one rank's lateness is not the step's time
            wall, cpu = time.perf_counter(), time.process_time()
            c.run(steps)
            if barrier:
                dist.barrier()
            times[c.label]["wall"].append((time.perf_counter() - wall) / steps)
            times[c.label]["cpu"].append((time.process_time() - cpu) / steps)
    return times


def _calls_per_step(contender: Contender) -> float:
    profile = cProfile.Profile()
    profile.enable()
    contender.run(PROFILED)
    profile.disable()
    calls: int = pstats.Stats(profile).total_calls  # type: ignore[attr-defined]
    return calls / PROFILED


def _losses(label: str, batches: list[Batch], steps: int) -> list[float] | str:
    """The loss of each of the first `steps` steps of a fresh copy, or why it failed."""
    built, failed = _build([label], batches)
    if failed:
        return failed[label]
    try:
        return [built[0].run(1).item() for _ in range(steps)]
    except Exception as exc:
        return f"{type(exc).__name__} in a step: {exc}".splitlines()[0][:160]


def _max_diff(a: list[float] | str, b: list[float] | str) -> float | str:
    if isinstance(a, str):
        return a
    if isinstance(b, str):
        return b
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _global_hooks() -> int:
    """How many global nn.Module hooks exist: any would slow every contender in the process."""
    from torch.nn.modules import module

    names = [n for n in dir(module) if n.startswith("_global_") and n.endswith("_hooks")]
    return sum(len(getattr(module, n)) for n in names)


def _ws1() -> dict[str, object]:
    zcomm.init_distributed("gloo")  # a world of one in this process, no port
    batches = _batches(MICRO_BATCH)
    labels = [PLAIN, AA, ZP0, ZP0_LEAF, ZP_DEFAULT, FSDP, FSDP_FUSED]
    checks = {label: _losses(label, batches, CHECKED) for label in labels if label != AA}
    broken = {label: why for label, why in checks.items() if isinstance(why, str)}
    if PLAIN in broken:
        broken[AA] = broken[PLAIN]
    contenders, failed = _build([x for x in labels if x not in broken], batches)
    failed.update(broken)
    hooks = _global_hooks()
    times = _rotate(contenders, STEPS, barrier=False)
    calls = {c.label: _calls_per_step(c) for c in contenders if c.label != AA}
    zcomm.destroy()
    return {"times": times, "failed": failed, "calls": calls, "checks": checks, "hooks": hooks}


def _rank_main() -> None:
    """One rank of the world-size-2 measurement (started by `main` with torchrun's variables)."""
    torch.set_num_threads(1)
    zcomm.init_distributed("gloo")
    rank = zcomm.get_rank()
    rows = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
    full = _batches(WORLD * MICRO_BATCH)
    mine = [(tokens[rows], targets[rows]) for tokens, targets in full]
    # correctness: the mean of the ranks' losses against plain PyTorch on the global batch
    reference = _losses(PLAIN, full, CHECKED)
    checks: dict[str, float | str] = {}
    for label in WS2_CONTENDERS:
        built, failed = _build([label], mine)
        if failed:
            checks[label] = failed[label]
            continue
        losses = []
        for _ in range(CHECKED):
            loss = built[0].run(1)
            dist.all_reduce(loss)
            losses.append(loss.item() / WORLD)
        checks[label] = _max_diff(losses, reference)
    contenders, failed = _build(WS2_CONTENDERS, mine)
    times = _rotate(contenders, STEPS_WS2, barrier=True)
    calls = {c.label: _calls_per_step(c) for c in contenders}
    # each rank prints its own figures (all_gather_object would need NumPy)
    result = {"times": times, "failed": failed, "checks": checks, "calls": calls}
    print("RESULT " + json.dumps(result), flush=True)
    zcomm.destroy()


def _ws2() -> dict[str, object]:
    ranks = run_ranks(__file__, ["--rank", *(["--quick"] if QUICK else [])], WORLD)
    parsed: dict[str, object] = dict(ranks[0], times=[r["times"] for r in ranks])
    return parsed


def _paired(a: list[float], b: list[float]) -> float:
    """The median of the per-round ratios a / b."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _verdict(ratio: float, target: float) -> str:
    return "meets" if ratio <= target else "misses"


def _print_ws1(result: dict[str, object]) -> None:
    times = result["times"]
    failed = result["failed"]
    assert isinstance(times, dict)
    assert isinstance(failed, dict)
    base = times[PLAIN]
    print(
        f"### World size 1: ms per step, medians of {ROUNDS} rounds x {STEPS} steps in rotating "
        f"order; ratios are medians of the per-round ratio to plain PyTorch\n"
    )
    print(
        "| contender | wall ms | CPU ms | wall / plain | CPU / plain | target "
        "| wall vs target | CPU vs target |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for label, t in times.items():
        wall, cpu = _paired(t["wall"], base["wall"]), _paired(t["cpu"], base["cpu"])
        zp = label.startswith("zpartition")
        target = f"<= {TARGET_WS1}x" if zp else ""
        verdicts = f"| {_verdict(wall, TARGET_WS1)} | {_verdict(cpu, TARGET_WS1)}" if zp else "| |"
        print(
            f"| {label} | {1e3 * statistics.median(t['wall']):.1f} "
            f"| {1e3 * statistics.median(t['cpu']):.1f} | {wall:.3f} | {cpu:.3f} | {target} "
            f"{verdicts} |"
        )
    for label, why in failed.items():
        print(f"| {label} | failed: {why} | | | | | | |")
    hooks = result["hooks"]
    if hooks:
        print(f"\nNote: {hooks} global nn.Module hooks were registered while the contenders were")
        print("built; they run for every contender in this process, plain PyTorch too.")
    print()


def _print_calls(ws1: dict[str, object], ws2: dict[str, object]) -> None:
    calls, calls2 = ws1["calls"], ws2["calls"]
    assert isinstance(calls, dict)
    assert isinstance(calls2, dict)
    print(
        f"### Python function calls per training step (cProfile, {PROFILED} steps; at world "
        f"size 1 zpartition's gathers short-cut, world size {WORLD} is rank 0's count)\n"
    )
    print(f"| contender | calls per step | x plain | target | at world size {WORLD} |")
    print("|---|---:|---:|---|---:|")
    for label, n in calls.items():
        if label == PLAIN:
            target = f"~{TARGET_CALLS_PLAIN / 1e3:.1f}k"
        elif label.startswith("zpartition"):
            verdict = _verdict(n, TARGET_CALLS_ZPARTITION)
            target = f"<= {TARGET_CALLS_ZPARTITION // 1000}k: {verdict}"
        else:
            target = ""
        at_ws2 = f"{calls2[label]:,.0f}" if label in calls2 else ""
        print(f"| {label} | {n:,.0f} | {n / calls[PLAIN]:.2f} | {target} | {at_ws2} |")
    print()


def _print_ws2(result: dict[str, object]) -> None:
    per_rank = result["times"]
    failed = result["failed"]
    assert isinstance(per_rank, list)
    assert isinstance(failed, dict)
    rank0 = per_rank[0]
    # CPU time of a round: the mean over the ranks
    cpu = {
        label: [statistics.mean(r[label]["cpu"][i] for r in per_rank) for i in range(ROUNDS)]
        for label in rank0
    }
    base = FSDP if FSDP in rank0 else None
    print(
        f"### World size {WORLD} (gloo, micro-batch {MICRO_BATCH} per rank): ms per step, medians "
        f"of {ROUNDS} rounds x {STEPS_WS2} steps in rotating order; ratios are medians of the "
        f"per-round ratio to FSDP2\n"
    )
    ranks = " | ".join(f"CPU ms rank {r}" for r in range(WORLD))
    print(f"| contender | wall ms | {ranks} | wall / FSDP2 | CPU / FSDP2 | target | verdict |")
    print("|---|---:|" + "---:|" * WORLD + "---:|---:|---:|---|")
    for label in rank0:
        wall = rank0[label]["wall"]
        cpus = " | ".join(f"{1e3 * statistics.median(r[label]['cpu']):.1f}" for r in per_rank)
        if base is None:
            ratios = "| n/a | n/a | | "
        else:
            w, c = _paired(wall, rank0[base]["wall"]), _paired(cpu[label], cpu[base])
            zp = label.startswith("zpartition")
            target = f"<= {TARGET_WS2}x" if zp else ""
            verdict = f"wall {_verdict(w, TARGET_WS2)}, CPU {_verdict(c, TARGET_WS2)}" if zp else ""
            ratios = f"| {w:.3f} | {c:.3f} | {target} | {verdict}"
        print(f"| {label} | {1e3 * statistics.median(wall):.1f} | {cpus} {ratios} |")
    for label, why in failed.items():
        print(f"| {label} | failed: {why} |" + " |" * (WORLD + 4))
    print()


def _fmt(value: object) -> str:
    return f"{value:.2e}" if isinstance(value, float) else f"failed: {value}"


def _print_checks(ws1: dict[str, object], ws2: dict[str, object]) -> None:
    checks1, checks2 = ws1["checks"], ws2["checks"]
    assert isinstance(checks1, dict)
    assert isinstance(checks2, dict)
    print(f"### Correctness: max |loss - plain PyTorch's loss| over the first {CHECKED} steps\n")
    print("| contender | world size 1 | world size 2 (mean of ranks vs plain on batch 8) |")
    print("|---|---:|---:|")
    plain = checks1[PLAIN]
    for label, losses in checks1.items():
        if label == PLAIN:
            continue
        ws2_cell = _fmt(checks2[label]) if label in checks2 else ""
        print(f"| {label} | {_fmt(_max_diff(losses, plain))} | {ws2_cell} |")
    if isinstance(plain, list):
        print(f"\nplain PyTorch's losses: {', '.join(f'{x:.6f}' for x in plain)}")


def main() -> None:
    """Measure everything and print the tables."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    ws1 = _ws1()
    ws2 = _ws2()
    print(
        f"## zpartition vs plain PyTorch and FSDP2: {BLOCKS}-block GPT, hidden {HIDDEN}, "
        f"sequence {SEQ}, micro-batch {MICRO_BATCH}, Adam; torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, 1 torch thread per process{' (--quick)' if QUICK else ''}\n"
    )
    _print_ws1(ws1)
    _print_ws2(ws2)
    _print_calls(ws1, ws2)
    _print_checks(ws1, ws2)
    print(f"\nwhole benchmark: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    if "--rank" in sys.argv:
        _rank_main()
    else:
        main()
