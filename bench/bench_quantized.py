"""ZeRO++'s quantized communication (#26) on the demo's GPT against plain ZeRO-3: qwZ
(``zero_quantized_weights``), qgZ (``zero_quantized_gradients``) and hpZ
(``zero_hpz_partition_size``); their bytes, their losses, and the quantizers' CPU time.

Run by ``nox -s bench -- quantized`` (or ``python bench/bench_quantized.py [--world 4]
[--bf16] [--skip-bytes]``, the options for part 2); prints markdown. Every engine releases a
module after its forward as bench_hybrid's do (``stage3_max_reuse_distance`` 0, a prefetch
bucket of about one block), so the backward gathers again: quantized under qwZ, within the
node under hpZ.

1. Bytes per rank per optimizer step, bf16, 4 ranks as 2 nodes x 2 (zcomm's
   `set_node_layout(2)`), accumulation 4, of the second step (the first, recording the
   prefetch trace, gathers more in its backward; the later ones are as the second): zcomm's
   accounting by link class (a call whose group spans nodes crosses them), per call the
   message's bytes as bench_hybrid counts them (all-gather: the output, reduce-scatter: the
   input, all-to-all: what is sent, this rank's own part included), exact whatever the
   machine. Then where they go: each collective's bytes by the phase it completed in
   (forward, backward, step) and link class.
2. Losses over LOSS_STEPS optimizer steps (the demo's accumulation, 2; fp32, the demo's dtype
   on CPU, or ``--bf16``) from the same weights on the same data, quantized against plain
   ZeRO-3: qwZ + qgZ at 2 ranks (one node, where hpZ's secondary group would be the world and
   change nothing), or with ``--world 4`` as 2 x 2 qwZ + qgZ and qwZ + qgZ + hpZ (hpZ in the
   node, qgZ hierarchical over the nodes; twice the ranks on the same cores, a few times the
   default's time): the largest relative gap of a step's loss (its micro-batches' mean over
   the ranks), and that of the final loss (the mean of the last TAIL steps). The engines
   live in the same processes and take their steps in turn.
3. The quantizers' CPU time per optimizer step of part 2's runs: the seconds spent in
   `zcomm.quantize` and `zcomm.dequantize` as the quantized collectives call them (timed in
   place by wrapping the names `zcomm._quantized_collectives` calls), against the step's
   time; and the step's time against plain ZeRO-3's, step by step (the engines take turns,
   so both see the same load), medians over the steps. The machine's load moves all of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import bench_hybrid
from _common import run_ranks

STEPS, LOSS_STEPS, TAIL = 2, 200, 10
Setting = tuple[bool, bool, int]  # zero_quantized_weights, _gradients, zero_hpz_partition_size
PLAIN: Setting = (False, False, 1)
BYTES_VARIANTS: dict[str, Setting] = {
    "plain ZeRO-3": PLAIN,
    "qwZ": (True, False, 1),
    "qgZ": (False, True, 1),
    "hpZ (zero_hpz_partition_size 2)": (False, False, 2),
    "qwZ + qgZ + hpZ": (True, True, 2),
}
# part 2's variants by world size: on one node (2 ranks) hpZ changes nothing
LOSS_VARIANTS: dict[int, dict[str, Setting]] = {
    2: {"qwZ + qgZ": (True, True, 1)},
    4: {"qwZ + qgZ": (True, True, 1), "qwZ + qgZ + hpZ": (True, True, 2)},
}


def _config(train_gpt: Any, setting: Setting, *, bf16: bool, accumulation: int) -> Any:
    weights, gradients, hpz = setting
    config = train_gpt.ds_config(3, bf16=bf16)
    config |= {"gradient_accumulation_steps": accumulation, "steps_per_print": 10**6}
    config["zero_optimization"] = dict(
        config["zero_optimization"],
        zero_quantized_weights=weights,
        zero_quantized_gradients=gradients,
        zero_hpz_partition_size=hpz,
        stage3_max_reuse_distance=0,
        stage3_prefetch_bucket_size=bench_hybrid.PREFETCH,
        stage3_max_live_parameters=2 * bench_hybrid.PREFETCH,
    )
    return config


def _timed(seconds: list[float], function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, adding the seconds each call takes to ``seconds[0]``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - start

    return timed


class _Run:
    """One engine of a worker, its optimizer steps, and what they measured."""

    def __init__(self, train_gpt: Any, setting: Setting, bf16: bool, accumulation: int) -> None:
        import zengine

        torch.manual_seed(0)  # the same weights for every setting
        config = _config(train_gpt, setting, bf16=bf16, accumulation=accumulation)
        self.engine, *_ = zengine.initialize(model=train_gpt.GPT(), config=config)
        self.data = train_gpt.batches(None, 0, torch.distributed.get_rank(), torch.device("cpu"))
        self.accumulation = accumulation
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.quantize_seconds: list[float] = []
        self.bytes: list[dict[str, list[int]]] = []  # per step: "phase collective" -> [in, across]

    def step(self, quantizing: list[float]) -> None:
        """One optimizer step, each phase's bytes apart (if the accounting is on)."""
        import zcomm

        step: dict[str, list[int]] = {}

        def record(phase: str) -> None:
            for op, stats in zcomm.comm_summary().items():
                pair = step.setdefault(f"{phase} {op}", [0, 0])
                pair[0] += stats.intra_node_bytes
                pair[1] += stats.inter_node_bytes
            zcomm.reset_comm_accounting()

        total, quantizing[0] = 0.0, 0.0
        zcomm.reset_comm_accounting()
        start = time.perf_counter()
        for _ in range(self.accumulation):
            loss = self.engine(*next(self.data))
            record("forward")
            self.engine.backward(loss)
            record("backward")
            self.engine.step()
            record("step")
            total += float(loss.detach())
        self.seconds.append(time.perf_counter() - start)
        self.quantize_seconds.append(quantizing[0])
        self.bytes.append(step)
        # the mean over the ranks, by torch's all-reduce: zcomm's accounting never sees it
        mean = torch.tensor(total / self.accumulation)
        torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
        self.losses.append(float(mean))

    def result(self) -> dict[str, Any]:
        totals = [sum(p[i] for p in self.bytes[-1].values()) for i in (0, 1)]
        return {
            "losses": self.losses,
            "seconds": self.seconds,
            "quantize_seconds": self.quantize_seconds,
            "intra": totals[0],
            "inter": totals[1],
            "by_op": self.bytes[-1],
        }


def _worker(mode: str, settings: list[Setting], bf16: bool, steps: int) -> None:
    """``bytes``: each setting's engine in turn, accounting on. ``losses``: every setting's
    engine at once, one step of each in turn."""
    import zcomm
    import zcomm._quantized_collectives as quantized

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    zcomm.set_node_layout(bench_hybrid.PER_NODE)
    train_gpt = bench_hybrid._train_gpt()
    quantizing = [0.0]  # seconds in zcomm.quantize and dequantize, as the collectives call them
    for name in ("quantize", "dequantize"):
        setattr(quantized, name, _timed(quantizing, getattr(quantized, name)))
    if mode == "bytes":
        zcomm.enable_comm_accounting()
        results = []
        for setting in settings:
            run = _Run(train_gpt, setting, bf16, bench_hybrid.ACCUMULATION)
            for _ in range(steps):
                run.step(quantizing)
            run.engine.destroy()
            results.append(run.result())
    else:
        runs = [_Run(train_gpt, s, bf16, train_gpt.ACCUMULATION) for s in settings]
        for _ in range(steps):
            for run in runs:
                run.step(quantizing)
        results = [run.result() for run in runs]
    rank = torch.distributed.get_rank()
    print("RESULT " + json.dumps({"rank": rank, "runs": results}), flush=True)


def _run(
    mode: str, settings: list[Setting], *, world: int, bf16: bool, steps: int
) -> list[list[dict[str, Any]]]:
    """Per rank, a result per setting."""
    args = ["--worker", mode, json.dumps(settings), str(int(bf16)), str(steps)]
    return [r["runs"] for r in run_ranks(__file__, args, world=world)]  # type: ignore[misc]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def bytes_tables() -> None:
    world, per_node = bench_hybrid.WORLD, bench_hybrid.PER_NODE
    ranks = _run("bytes", list(BYTES_VARIANTS.values()), world=world, bf16=True, steps=STEPS)
    rows = []
    for i, name in enumerate(BYTES_VARIANTS):
        intra = statistics.median(float(r[i]["intra"]) for r in ranks)
        inter = statistics.median(float(r[i]["inter"]) for r in ranks)
        rows.append((name, intra, inter, ranks[0][i]))
    base_all, base_inter = rows[0][1] + rows[0][2], rows[0][2]
    print(
        f"### 1. bytes per rank per optimizer step: demo GPT, bf16, {world} ranks as "
        f"{world // per_node} nodes x {per_node}, accumulation {bench_hybrid.ACCUMULATION}, "
        "the second step (the first records the prefetch trace); the median over the ranks\n"
    )
    print(
        "| variant | all links | ratio to plain | across nodes | ratio to plain | within a node |"
    )
    print("|---|---|---|---|---|---|")
    for name, intra, inter, _ in rows:
        print(
            f"| {name} | {_mib(intra + inter)} | {(intra + inter) / base_all:.3f}x | "
            f"{_mib(inter)} | {inter / base_inter:.3f}x | {_mib(intra)} |"
        )
    print("\nWhere they go: rank 0's, by the phase a call completed in\n")
    print("| variant | phase, collective | within a node | across nodes |")
    print("|---|---|---|---|")
    for name, _, _, rank0 in rows:
        for key, (intra, inter) in rank0["by_op"].items():
            print(f"| {name} | {key} | {_mib(intra)} | {_mib(inter)} |")


def _gaps(losses: list[float], plain: list[float]) -> tuple[float, float]:
    """The largest relative gap of a step's loss, and that of the final loss."""
    worst = max(abs(q - p) / p for q, p in zip(losses, plain, strict=True))
    final, base = statistics.mean(losses[-TAIL:]), statistics.mean(plain[-TAIL:])
    return worst, abs(final - base) / base


def loss_and_time_tables(world: int, bf16: bool, steps: int) -> None:
    variants = LOSS_VARIANTS[world]
    settings = [PLAIN, *variants.values()]
    plain, *runs = _run("losses", settings, world=world, bf16=bf16, steps=steps)[0]
    shape = f"{world // bench_hybrid.PER_NODE} x {bench_hybrid.PER_NODE}" if world > 2 else "2"
    dtype = "bf16" if bf16 else "fp32"
    print(
        f"\n### 2. losses, {steps} optimizer steps, {dtype}, {shape} ranks, against plain "
        f"ZeRO-3 (final loss: the mean of the last {TAIL} steps)\n"
    )
    print("| variant | largest gap of a step | gap of the final loss | final loss |")
    print("|---|---|---|---|")
    print(f"| plain ZeRO-3 | | | {statistics.mean(plain['losses'][-TAIL:]):.4f} |")
    for name, run in zip(variants, runs, strict=True):
        worst, final = _gaps(run["losses"], plain["losses"])
        tail = statistics.mean(run["losses"][-TAIL:])
        print(f"| {name} | {worst:.3%} | {final:.3%} | {tail:.4f} |")
    print(f"\n### 3. CPU time per optimizer step, the same runs (medians over the {steps} steps)\n")
    print(
        "| variant | step | plain's step, in turn | added, step by step | "
        "in zcomm.quantize + dequantize | of the step |"
    )
    print("|---|---|---|---|---|---|")
    base = plain["seconds"]
    print(f"| plain ZeRO-3 | {statistics.median(base) * 1e3:.1f} ms | | | | |")
    for name, run in zip(variants, runs, strict=True):
        step = statistics.median(run["seconds"])
        added = statistics.median(q - p for q, p in zip(run["seconds"], base, strict=True))
        quantize = statistics.median(run["quantize_seconds"])
        print(
            f"| {name} | {step * 1e3:.1f} ms | {statistics.median(base) * 1e3:.1f} ms | "
            f"{added * 1e3:+.1f} ms | {quantize * 1e3:.1f} ms | {quantize / step:.1%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=[2, 4], default=2, help="part 2's ranks")
    parser.add_argument("--bf16", action="store_true", help="part 2 in bf16 (default fp32)")
    parser.add_argument("--steps", type=int, default=LOSS_STEPS, help="part 2's steps")
    parser.add_argument("--skip-bytes", action="store_true", help="part 2 and 3 only")
    args = parser.parse_args()
    if not args.skip_bytes:
        bytes_tables()
    loss_and_time_tables(args.world, args.bf16, args.steps)


if __name__ == "__main__":
    if len(sys.argv) > 5 and sys.argv[1] == "--worker":
        mode, settings, bf16, steps = sys.argv[2:6]
        chosen: list[Setting] = [(bool(w), bool(g), int(h)) for w, g, h in json.loads(settings)]
        _worker(mode, chosen, bf16 == "1", int(steps))
    else:
        main()
