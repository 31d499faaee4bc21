"""A projection (#25): step time of a 7 B Llama on 8-GPU nodes at 1-64 nodes, plain ZeRO-3
against hybrid sharding, ZeRO++ hpZ and node-local accumulation, from a cost model checked
against the bytes this repo measures (these machines have one node and no GPU).

The model lists, for one optimizer step, every collective a rank takes part in: its message
(zcomm's accounting convention: all-gather the output's bytes, reduce-scatter the input's,
all-reduce the tensor's), its group (nodes x ranks per node), its phase (forward, backward or
the step). The check sums the messages by link class for the demo GPT as bench_hybrid runs it
and sets them against bench_hybrid's measurement, made in the same run. The projection turns
messages into ring wire bytes per rank, split hierarchically by link class, and into time.

    nox -s bench -- projection          (python bench/bench_projection.py [--no-measure])
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass
from typing import Literal

import bench_hybrid
import zpartition
from _common import run_ranks

# -- inputs (assumptions unless a source is named) --------------------------------------------
LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 32, 4096, 11008, 32000  # Llama-2-7B's config.json
SEQ, MICRO_BATCH, ACCUMULATIONS = 4096, 1, (1, 8)
PARAM_B, GRAD_B, STATE_B = 2, 2, 12  # bf16 params and gradients; fp32 master, Adam m and v
GPUS, NODES = 8, (1, 4, 16, 64)  # 8 x H100 per node
NVLINK = 450e9  # B/s per GPU per direction achievable in NCCL all-gather: an assumption
NETWORKS = {  # inter-node bandwidth per GPU, B/s (line rate; achieved is lower: to check)
    "8 x 400 Gb/s InfiniBand per node (50 GB/s per GPU)": 8 * 400e9 / 8 / GPUS,
    "100 Gb/s Ethernet per node (1.56 GB/s per GPU)": 100e9 / 8 / GPUS,
}
LAT_NODE, LAT_HOP = 10e-6, 5e-6  # s per collective within a node, + per inter-node ring step
TFLOPS = 400e12  # achieved bf16 FLOP/s per H100: an assumption, nothing measured here
HBM, ADAM_B = 2.0e12, 32  # optimizer step: bytes moved per parameter at this HBM bandwidth
ZERO = zpartition.ZeroParamConfig()  # DeepSpeed's defaults: persistence 1e5, reuse 1e9, ...
HEADER_B = 64  # zpartition's agreement header: 8 int64 per rank ([Note: agreement])

Op = Literal["all_gather", "reduce_scatter", "all_reduce"]
Phase = Literal["forward", "backward", "step"]
Strategy = Literal["plain ZeRO-3", "hybrid", "hpZ", "node-local", "hpZ + node-local"]
STRATEGIES: tuple[Strategy, ...] = (
    "plain ZeRO-3",
    "hybrid",
    "hpZ",
    "node-local",
    "hpZ + node-local",
)


@dataclass(frozen=True)
class Group:
    nodes: int
    per_node: int

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class Collective:
    op: Op
    message: int  # bytes, zcomm's accounting convention
    group: Group
    phase: Phase
    calls: int  # collectives it stands for (latency)
    per_step: bool  # once per optimizer step, else once per micro-batch


@dataclass(frozen=True)
class Model:
    """A partitioned model: its units in forward order (the sizes of each module's own
    parameters above the persistence threshold) and the persistent parameters' sizes."""

    units: tuple[tuple[int, ...], ...]
    persistent: tuple[int, ...]

    @property
    def params(self) -> int:
        return sum(map(sum, self.units)) + sum(self.persistent)


def llama_7b() -> Model:
    h, i = HIDDEN, INTERMEDIATE
    layer = [(h * h,)] * 4 + [(h * i,)] * 3  # q k v o, gate up down: one unit per Linear
    units = ((VOCAB * h,), *layer * LAYERS, (VOCAB * h,))  # embedding, layers, untied head
    return Model(units, (h,) * (2 * LAYERS + 1))  # the RMSNorms: under 1e5 elements


def demo_gpt() -> tuple[Model, int]:
    """The demo GPT of examples/train_gpt.py as zpartition cuts it: one unit per module with
    parameters of its own, parameters of at most the threshold in the persistent unit."""
    train_gpt = bench_hybrid._train_gpt()
    zero = train_gpt.ds_config(3, bf16=False)["zero_optimization"]
    threshold = zero["stage3_param_persistence_threshold"]
    units: list[tuple[int, ...]] = []
    persistent: list[int] = []
    for module in train_gpt.GPT().modules():  # registration order: only the reuse rule reads it
        sizes = [p.numel() for p in module.parameters(recurse=False)]
        if big := tuple(n for n in sizes if n > threshold):
            units.append(big)
        persistent += [n for n in sizes if n <= threshold]
    return Model(tuple(units), tuple(persistent)), 4  # fp32


def gathered(sizes: tuple[int, ...], ranks: int, b: int) -> int:
    """An all-gather's output: every rank's shard, each chunk ceil(n/W) padded to 16 bytes."""
    return ranks * sum(math.ceil(math.ceil(n / ranks) * b / 16) * 16 for n in sizes)


def shard(sizes: tuple[int, ...], ranks: int, b: int) -> int:
    return sum(math.ceil(n / ranks) * b for n in sizes)


def plan(s: Strategy, m: Model, world: Group, pb: int, gb: int) -> list[Collective]:
    """Every collective of one optimizer step, per rank. A unit gathered in the forward is
    kept for the backward when it is reused within max_reuse_distance elements: zpartition's
    rule, with the distance 2 x the elements gathered after it (the forward's rest, then the
    backward up to it)."""
    node, flat = Group(1, world.per_node), sum(m.units, ())
    group = node if s == "hybrid" else world  # where parameters and gradients are sharded
    back = node if s.startswith("hpZ") else group  # where the backward gathers (hpZ: secondary)
    # node-local accumulation: each micro-batch reduce-scatters within the node, and the
    # node's shards (one per node) across the nodes once per step
    local = s.endswith("node-local") and world.nodes > 1
    after = [sum(map(sum, m.units[k + 1 :])) for k in range(len(m.units))]
    again = [u for u, a in zip(m.units, after, strict=True) if 2 * a >= ZERO.max_reuse_distance]
    every = flat + m.persistent
    buckets = max(1, math.ceil(sum(every) / ZERO.reduce_bucket_size))
    out = [
        Collective(
            "all_gather", gathered(flat, group.size, pb), group, "forward", len(m.units), False
        ),
        Collective(
            "all_gather",
            gathered(sum(again, ()), back.size, pb),
            back,
            "backward",
            len(again),
            False,
        ),
        Collective(
            "reduce_scatter",
            group.size * shard(every, group.size, gb),
            node if local else group,
            "backward",
            buckets,
            False,
        ),
        Collective("all_gather", gathered(m.persistent, group.size, pb), group, "step", 1, True),
        Collective("all_reduce", 4, group, "step", 1, True),  # the gradient norm (clipping)
    ]
    if local:  # one shard per node of every gradient, and a presence flag per unit
        flags = len(m.units) + bool(m.persistent)
        across = world.nodes * (shard(every, group.size, gb) + gb * flags)
        out.append(Collective("reduce_scatter", across, Group(world.nodes, 1), "step", 1, True))
    if s == "hybrid" and world.nodes > 1:  # the shard gradient across nodes, at the boundary
        replicas = Group(world.nodes, 1)
        out.append(
            Collective("all_reduce", shard(every, group.size, gb), replicas, "step", 1, True)
        )
    return out


def per_step(c: Collective, accumulation: int) -> int:
    return 1 if c.per_step else accumulation


def messages(cs: list[Collective], accumulation: int) -> tuple[int, int]:
    """(within a node, across nodes) message bytes per optimizer step: the accounting's sum."""
    inter = sum(c.message * per_step(c, accumulation) for c in cs if c.group.nodes > 1)
    return sum(c.message * per_step(c, accumulation) for c in cs) - inter, inter


def wire(c: Collective) -> tuple[float, float]:
    """Ring wire bytes per rank (within a node, across nodes), hierarchically: the inter-node
    ring of the same local rank carries (N-1)/N of M/g, NVLink (g-1)/g of M; both summed give
    (n-1)/n of M (2x for an all-reduce)."""
    k, g, n = (2 if c.op == "all_reduce" else 1), c.group.per_node, c.group.nodes
    return k * (g - 1) / g * c.message, k * (n - 1) / n * c.message / g


def seconds(c: Collective, inter_bw: float) -> float:
    """Latency per collective, then the slower link class (a ring pipelines both)."""
    intra, inter = wire(c)
    k, g, n = (2 if c.op == "all_reduce" else 1), c.group.per_node, c.group.nodes
    latency = c.calls * k * (LAT_NODE * (g > 1) + LAT_HOP * (n - 1))
    return latency + max(intra / NVLINK, inter / inter_bw)


@dataclass(frozen=True)
class Step:
    total: float
    compute: float
    optimizer: float
    intra_gb: float
    inter_gb: float

    @property
    def exposed(self) -> float:
        return self.total - self.compute - self.optimizer


def project(s: Strategy, nodes: int, accumulation: int, inter_bw: float) -> Step:
    """Per micro-batch max(compute, communication) in each pass (forward 1/3 of the FLOPs,
    backward 2/3); the step's collectives and the optimizer exposed, after the last."""
    m, world = llama_7b(), Group(nodes, GPUS)
    cs = plan(s, m, world, PARAM_B, GRAD_B)
    compute = 6 * m.params * SEQ * MICRO_BATCH / TFLOPS

    def comm(phase: Phase) -> float:
        return sum(seconds(c, inter_bw) for c in cs if c.phase == phase)

    micro = max(compute / 3, comm("forward")) + max(2 * compute / 3, comm("backward"))
    sharded = GPUS if s == "hybrid" else world.size
    optimizer = m.params / sharded * ADAM_B / HBM
    total = accumulation * micro + comm("step") + optimizer
    intra = sum(wire(c)[0] * per_step(c, accumulation) for c in cs)
    inter = sum(wire(c)[1] * per_step(c, accumulation) for c in cs)
    return Step(total, accumulation * compute, optimizer, intra / 1e9, inter / 1e9)


def check(measure: bool) -> None:
    """The demo GPT as bench_hybrid runs it, predicted and (live) measured."""
    m, b = demo_gpt()
    acc, per_node, world = bench_hybrid.ACCUMULATION, bench_hybrid.PER_NODE, bench_hybrid.WORLD
    print(
        f"## Check: the demo GPT ({m.params} parameters, fp32), {world} ranks as "
        f"{world // per_node} nodes x {per_node}, accumulation {acc}\n"
    )
    again = plan("plain ZeRO-3", m, Group(1, world), b, b)[1].calls
    print(
        f"Units: {len(m.units)} gathered per forward, {again} again in the backward (the "
        f"whole model is within max_reuse_distance); {len(m.persistent)} persistent "
        "parameters, gathered once per step. Headers: zpartition's agreement all-gathers "
        f"([Note: agreement]), {HEADER_B} B per rank each, over the shard group: 3 per "
        "micro-batch (gather, reduce, end of backward) and 1 per step (the persistent "
        "unit's refresh), as zpartition issues them for this model, whose units all fit one "
        "prefetch batch (counted from a trace, not derived).\n"
    )
    print("| variant | link | model (payload) | + headers | measured | measured / model+headers |")
    print("|---|---|---:|---:|---:|---:|")
    checked: dict[Strategy, str] = {  # the strategy, and bench_hybrid's variant that runs it
        "plain ZeRO-3": "plain ZeRO-3",
        "hybrid": "hybrid, shard within a node (mics_shard_size)",
        "node-local": "node-local accumulation",
    }
    for s, name in checked.items():
        setting = bench_hybrid.VARIANTS[name]
        cs = plan(s, m, Group(world // per_node, per_node), b, b)
        group = cs[0].group
        headers = (3 * acc + 1) * HEADER_B * group.size
        got: list[float] | None = None
        if measure:  # bench_hybrid's own worker: the same training, the accounting's medians
            args = bench_hybrid.worker_args(setting, release=False)  # DeepSpeed's defaults
            ranks = run_ranks(bench_hybrid.__file__, args, world=world)
            got = [statistics.median(float(str(r[k])) for r in ranks) for k in ("intra", "inter")]
        for link, model in enumerate(messages(cs, acc)):
            extra = headers if (group.nodes > 1) == bool(link) else 0
            seen = "-" if got is None else f"{got[link]:.0f}"
            ratio = (
                "-" if got is None or not model + extra else f"{got[link] / (model + extra):.6f}"
            )
            print(
                f"| {name} | {('within a node', 'across nodes')[link]} | {model} | "
                f"{model + extra} | {seen} | {ratio} |"
            )
    print()


def main() -> None:
    measure = "--no-measure" not in sys.argv[1:]
    m = llama_7b()
    wide = plan("plain ZeRO-3", m, Group(NODES[-1], GPUS), PARAM_B, GRAD_B)
    calls = sum(c.calls for c in wide if not c.per_step)
    kept = len(m.units) - wide[1].calls
    print(f"# Projection: 7 B Llama ({m.params / 1e9:.2f} B parameters) on {GPUS}-GPU nodes\n")
    print("## Assumptions\n")
    for line in (
        f"Model: Llama-2-7B's shape ({LAYERS} layers, hidden {HIDDEN}, intermediate "
        f"{INTERMEDIATE}, vocabulary {VOCAB}, untied head); bf16 parameters and gradients on the "
        "wire, fp32 master and Adam state (16 B per parameter in all)",
        f"Batch: sequence {SEQ}, micro-batch {MICRO_BATCH} per GPU, accumulation "
        f"{' and '.join(map(str, ACCUMULATIONS))}",
        f"Compute: 6 x parameters x tokens FLOPs (attention's ~16% more at this length left "
        f"out) at {TFLOPS / 1e12:.0f} TFLOP/s achieved per GPU: an assumption, no GPU "
        "figure is measured in this repo; forward 1/3, backward 2/3",
        f"Links: NVLink {NVLINK / 1e9:.0f} GB/s per GPU per direction (assumed achievable in "
        "NCCL); inter-node per GPU: " + "; ".join(NETWORKS) + " at line rate",
        f"Latency: {LAT_NODE * 1e6:.0f} us per collective within a node plus {LAT_HOP * 1e6:.0f} "
        "us per inter-node step (N-1 steps, hierarchical; x2 for an all-reduce); one "
        f"collective per gathered unit ({len(m.units)}: each Linear, embedding, head), "
        f"reduce-scatters in buckets of {ZERO.reduce_bucket_size:.0e} elements: {calls} "
        "collectives per micro-batch; agreement headers left out",
        "Bytes: ring convention, (n-1)/n of the message per rank for all-gather and "
        "reduce-scatter, 2(n-1)/n for all-reduce, split hierarchically: (N-1)/N of M/8 on the "
        "rank's NIC, 7/8 of M on NVLink; a collective takes max(NVLink time, NIC time)",
        "Overlap: per micro-batch, step time = max(compute, communication) for the forward and "
        "again for the backward (all collectives of a pass share the links: their times add); "
        "the optimizer step, the persistent refresh, the norm and hybrid's cross-node "
        "all-reduce (zengine runs it at the step; FSDP2's HSDP overlaps it with the backward) "
        f"are exposed. Optimizer: {ADAM_B} B per parameter of the shard at "
        f"{HBM / 1e12:.1f} TB/s",
        f"Schedules: plain ZeRO-3 gathers and reduce-scatters over the world; hybrid within the "
        "node, all-reducing the node's gradient shard across nodes once per optimizer step; "
        "node-local accumulation gathers as plain ZeRO-3, reduce-scatters within the node every "
        "micro-batch and across the nodes once per step (one shard per node held between); "
        "hpZ (ZeRO++) gathers over the world in the forward, keeps a node-local secondary shard "
        "and gathers it in the backward, reduce-scatters over the world every micro-batch (so its "
        "cross-node gradient traffic is not once per step). Units reused within "
        f"{ZERO.max_reuse_distance:.0e} elements stay gathered from the forward into the "
        f"backward (zpartition's and DeepSpeed's default): {kept} of {len(m.units)} units at 7 B",
    ):
        print(f"- {line}")
    print()
    check(measure)
    nodes, bw = NODES[2], next(iter(NETWORKS.values()))
    print(f"## Per collective at {nodes} nodes, InfiniBand: GB per rank (wire) and ms\n")
    print(
        "| strategy | collective | group (nodes x GPUs) | phase | message GB | NVLink GB "
        "| NIC GB | ms |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|")
    for s in STRATEGIES:
        for c in plan(s, m, Group(nodes, GPUS), PARAM_B, GRAD_B):
            intra, inter = wire(c)
            when = "per step" if c.per_step else "per micro-batch"
            print(
                f"| {s} | {c.op} x {c.calls} | {c.group.nodes} x {c.group.per_node} | "
                f"{c.phase}, {when} | {c.message / 1e9:.3f} | {intra / 1e9:.3f} | "
                f"{inter / 1e9:.3f} | {seconds(c, bw) * 1e3:.1f} |"
            )
    print()
    for net, bw in NETWORKS.items():
        print(f"## Projection, {net}\n")
        print(
            "| nodes | accum | strategy | step s | compute s | exposed comm s | optimizer s "
            "| tokens/s per GPU | GB/rank/step NVLink | GB/rank/step NIC |"
        )
        print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for nodes in NODES:
            for acc in ACCUMULATIONS:
                for s in STRATEGIES:
                    r = project(s, nodes, acc, bw)
                    tokens = SEQ * MICRO_BATCH * acc / r.total
                    print(
                        f"| {nodes} | {acc} | {s} | {r.total:.3f} | {r.compute:.3f} | "
                        f"{r.exposed:.3f} | {r.optimizer:.4f} | {tokens:.0f} | "
                        f"{r.intra_gb:.1f} | {r.inter_gb:.2f} |"
                    )
        for acc in ACCUMULATIONS:
            plain = [project("plain ZeRO-3", n, acc, bw).total for n in NODES[1:]]
            ratios = {
                h: ", ".join(
                    f"{p / project(h, n, acc, bw).total:.2f}x"
                    for p, n in zip(plain, NODES[1:], strict=True)
                )
                for h in STRATEGIES[1:]
            }
            print(
                f"\nThroughput against plain ZeRO-3 at {', '.join(map(str, NODES[1:]))} nodes, "
                f"accumulation {acc}: " + "; ".join(f"{h} {r}" for h, r in ratios.items())
            )
        print()
    states = (PARAM_B + GRAD_B + STATE_B) * m.params / 1e9
    act = 34 * SEQ * HIDDEN * LAYERS * MICRO_BATCH / 1e9
    print("## Memory per GPU (model states; + activations)\n")
    print("| strategy | " + " | ".join(f"N = {n}" for n in NODES) + " |")
    print("|---|" + "---:|" * len(NODES))
    for s in STRATEGIES:
        secondary = PARAM_B * m.params / GPUS / 1e9 if s.startswith("hpZ") else 0.0  # its copy
        held = GRAD_B * m.params / GPUS / 1e9 if s.endswith("node-local") else 0.0  # 1 per node
        gb = [
            states / GPUS if s == "hybrid" else states / (GPUS * n) + secondary + held * (n > 1)
            for n in NODES
        ]
        print(f"| {s} | " + " | ".join(f"{x:.1f} GB" for x in gb) + " |")
    print(
        f"\nActivations, roughly 34 x s x h x layers bytes (Korthikanti et al. 2022, flash "
        f"attention, no recomputation; SwiGLU holds more): ~{act:.0f} GB; so hybrid's "
        f"{states / GPUS:.1f} GB of states + ~{act:.0f} GB fits an 80 GB H100.\n"
    )
    print("## To check on real hardware\n")
    for line in (
        "Achieved NCCL bandwidth per message size (nccl-tests all_gather / reduce_scatter / "
        "all_reduce at 1, 4, 16, 64 nodes): line rate is assumed; 7 B's units are 34-262 MB",
        "Overlap: the fraction of each pass's collectives hidden behind compute (profile one "
        "step; NCCL kernels take SMs from the GEMMs, so compute slows while they run)",
        f"Latency at {NODES[-1]} nodes: {NODES[-1] - 1} inter-node steps x {calls} "
        "collectives per micro-batch; hidden behind compute here, not if it is 10x higher",
        "Hierarchical all-gather against NCCL's flat ring (and PAT): the model assumes the NIC "
        "carries only (N-1)/N of M/8",
        "The achieved TFLOP/s of a 7 B Llama at sequence 4096 on one GPU (400 assumed)",
        "Memory: activations at sequence 4096 without recomputation, and hpZ's secondary shard",
        "hpZ's backward gathers: the check runs DeepSpeed's defaults, under which the demo stays "
        "gathered from its forward into its backward and hpZ changes nothing, so the check "
        "covers plain ZeRO-3, hybrid and node-local accumulation; hpZ's bytes are "
        "bench_hybrid's (units released after the forward), set against no model here",
        "The reductions at the step (hybrid's all-reduce, node-local accumulation's "
        "reduce-scatter across nodes) are exposed in this model, as zstack runs them at the end "
        "of the last backward; overlapping them with that backward (FSDP2's HSDP does) would "
        "hide most of them: measure how much",
    ):
        print(f"- {line}")


if __name__ == "__main__":
    main()
