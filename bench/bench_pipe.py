"""zengine.pipe: time per batch against zpipe.simulate, schedule against schedule, and against
torch.distributed.pipelining's Schedule1F1B on the same model.

Run by ``nox -s bench -- pipe`` (or ``python bench/bench_pipe.py [--quick]``).

The model is the benchmarks' GPT (bench/_common.py) cut into 4 even stages: 8 blocks of hidden
128 (4 heads), 2 per stage; stage 0 also holds the token and position embeddings and stage 3
the final LayerNorm and the head (vocab 128, so neither weighs much). Sequence 64, micro-batch
4, 16 micro-batches per batch, cross-entropy on random targets, fp32, Adam (lr 1e-3). Four
processes, one per stage, one torch thread each, gloo on CPU.

All contenders live in the same four processes and run in rounds, one batch each per round,
the order rotating every round, with a barrier before and after every batch; the table shows
the median wall time of a batch over the measured rounds.

1. zengine with 1F1B (DeepSpeed's TrainSchedule), ZB-H1 (its backward split in an
   input-gradient and a weight-gradient half) and GPipe, through ``engine.train_batch``.
2. torch.distributed.pipelining: ``PipelineStage`` and ``Schedule1F1B`` on the same stages,
   then ``torch.optim.Adam``.
3. The prediction: ``zpipe.simulate`` of each schedule with every stage's own mean forward,
   backward (or input- and weight-gradient) times, recorded by the engine during the measured
   batches (``engine.compute_times``), and the time of one activation message between two
   stages, measured by a ping-pong before the rounds. The schedule simulated is the one the
   engine runs on gloo, each send moved up to right after its computation (_eager.py).
   Target: the measured time within 10% of the prediction. The simulator gives every stage a
   processor of its own; where the machine has fewer cores than stages, the stages' costs in
   the run include waiting for a core, so two more columns say how far the machine is from
   that: the simulation with each stage's costs measured alone (the others waiting at a
   barrier), and the work of all stages, so measured, divided by the cores (no schedule can
   beat it on this machine).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Block, run_ranks

QUICK = "--quick" in sys.argv
STAGES, MICRO_BATCHES = 4, 16
VOCAB, HIDDEN, HEADS, SEQ, MICRO, BLOCKS = 128, 128, 4, 64, 4, 8
WARMUP, ROUNDS = (1, 2) if QUICK else (2, 7)
SCHEDULES = {"1f1b": "1F1B", "zero_bubble": "ZB-H1", "gpipe": "GPipe"}
TORCH = "torch Schedule1F1B"


# -- the model, as layers ----------------------------------------------------------------------


def _layers() -> list[Any]:
    import torch
    from torch import nn

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, HIDDEN)
            self.pos = nn.Embedding(SEQ, HIDDEN)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
            return out

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(HIDDEN)
            self.head = nn.Linear(HIDDEN, VOCAB)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.ln(x))
            return out

    return [Embed, *[Block] * BLOCKS, Head]


BOUNDS = [0, 3, 5, 7, 10]  # embeddings + 2 blocks | 2 blocks | 2 blocks | 2 blocks + head


def _build(index: int, cls: Any) -> Any:
    import torch

    torch.manual_seed(1234 + index)  # each layer the same in every contender
    return cls(HIDDEN, HEADS) if cls.__name__ == "Block" else cls()


def _loss(logits: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- the ranks ---------------------------------------------------------------------------------


def _engine(schedule: str) -> Any:
    import zengine
    from zengine.pipe import LayerSpec, PipelineModule

    specs = [
        LayerSpec(cls, HIDDEN, HEADS) if cls.__name__ == "Block" else LayerSpec(cls)
        for cls in _layers()
    ]
    module = PipelineModule(
        specs,
        num_stages=STAGES,
        loss_fn=_loss,
        seed_layers=True,
        partition_method=BOUNDS,
    )
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "pipeline": {"schedule": schedule},
    }
    engine, *_ = zengine.initialize(model=module, config=config)
    return engine


class _TorchPipe:
    """The same stage under torch.distributed.pipelining."""

    def __init__(self, stage: int) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        layers = [_build(i, cls) for i, cls in enumerate(_layers())]
        self.module = nn.Sequential(*layers[BOUNDS[stage] : BOUNDS[stage + 1]])
        group = dist.new_group(list(range(STAGES)))
        pipe_stage = PipelineStage(self.module, stage, STAGES, torch.device("cpu"), group=group)
        self.schedule = Schedule1F1B(pipe_stage, n_microbatches=MICRO_BATCHES, loss_fn=_loss)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=1e-3)
        self.stage = stage

    def train_batch(self, tokens: Any) -> None:
        if self.stage == 0:
            self.schedule.step(tokens)
        elif self.stage == STAGES - 1:
            self.schedule.step(target=tokens.roll(1, dims=1))
        else:
            self.schedule.step()
        self.optimizer.step()
        self.optimizer.zero_grad()


def _message_seconds(stage: int) -> float:
    """One activation message between stages 0 and 1 (half a ping-pong), as the engine sends
    it; the other stages wait."""
    import torch
    import torch.distributed as dist

    from zengine.pipe._link import Link

    link = Link(stage, STAGES, lambda s: s, timeout=60.0)
    x = torch.randn(MICRO, SEQ, HIDDEN)
    times = []
    for i in range(30):
        dist.barrier()
        start = time.perf_counter()
        if stage == 0:
            link.send_activation(x, to=1, micro_batch=i, source=0)
            link.recv_grads(
                [(x.dtype, tuple(x.shape))], frm=1, micro_batch=i, source=1, where="ping"
            )
        elif stage == 1:
            (got,), _ = link.recv_activation(frm=0, micro_batch=i, source=0, where="ping")
            link.send_grads([got], to=0, micro_batch=i, source=1)
        link.drain()
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[5:])


def _alone(stage: int, module: Any) -> dict[str, float]:
    """This stage's forward, backward and split backward per micro-batch, each stage measured
    while the others wait at a barrier (no other rank computing on the machine)."""
    import torch
    import torch.distributed as dist

    from zengine.pipe._split import SplitBackward

    params = list(module.parameters())
    found: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    for turn in range(STAGES):
        dist.barrier()
        if turn != stage:
            continue
        for i in range(12):
            if stage == 0:
                x = torch.randint(0, VOCAB, (MICRO, SEQ))
            else:
                x = torch.randn(MICRO, SEQ, HIDDEN, requires_grad=True)
            start = time.perf_counter()
            y = module(x)
            if stage == STAGES - 1:
                y = _loss(y, torch.randint(0, VOCAB, (MICRO, SEQ)))
            forward = time.perf_counter() - start
            grad = torch.ones_like(y)
            start = time.perf_counter()
            if i % 2:
                y.backward(grad)
                times = {"F": forward, "B": time.perf_counter() - start}
            else:
                split = SplitBackward([y], [grad], [x] if stage else [], params)
                split.input_pass()
                half = time.perf_counter()
                split.weight_pass()
                times = {"F": forward, "I": half - start, "W": time.perf_counter() - half}
            if i >= 4:
                for kind, value in times.items():
                    found[kind].append(value)
        module.zero_grad(set_to_none=True)
    dist.barrier()
    return {kind: statistics.median(v) for kind, v in found.items() if v}


def worker() -> None:
    import torch
    import torch.distributed as dist

    import zcomm

    torch.set_num_threads(1)
    zcomm.init_distributed("gloo")
    stage = dist.get_rank()
    message = _message_seconds(stage)
    engines = {name: _engine(name) for name in SCHEDULES}
    torch_pipe = _TorchPipe(stage)
    contenders: dict[str, Any] = {**engines, TORCH: torch_pipe}
    alone = _alone(stage, torch_pipe.module)
    g = torch.Generator().manual_seed(0)
    walls: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(WARMUP + ROUNDS):
        tokens = torch.randint(0, VOCAB, (MICRO * MICRO_BATCHES, SEQ), generator=g)
        if round_ == WARMUP:
            for engine in engines.values():
                engine.compute_times = {}
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            contender = contenders[name]
            if name in engines:
                pieces = tokens.view(MICRO_BATCHES, MICRO, SEQ)
                contender.train_batch(iter([(p, p.roll(1, dims=1)) for p in pieces]))
            else:
                contender.train_batch(tokens)
            dist.barrier()
            if round_ >= WARMUP:
                walls[name].append(time.perf_counter() - start)
    times = {
        name: {kind: statistics.mean(v) for kind, v in engine.compute_times.items()}
        for name, engine in engines.items()
    }
    result = {"stage": stage, "walls": walls, "times": times, "alone": alone, "message": message}
    print("RESULT " + json.dumps(result))


# -- the report --------------------------------------------------------------------------------


def _costs(times: list[dict[str, float]], split: bool) -> dict[str, Any]:
    forward = [t["F"] for t in times]
    if split:
        return {
            "forward": forward,
            "backward": [t["I"] for t in times],
            "weight": [t["W"] for t in times],
        }
    return {"forward": forward, "backward": [t["B"] for t in times]}


def _simulate(name: str, times: list[dict[str, float]], comm: float) -> Any:
    import zpipe
    from zengine.pipe import SCHEDULES as CLASSES
    from zengine.pipe._eager import EagerSends

    # the schedule as the engine runs it on gloo: each send right after its computation
    costs = _costs(times, split=name == "zero_bubble")
    return zpipe.simulate(EagerSends, MICRO_BATCHES, STAGES, comm=comm, base=CLASSES[name], **costs)


def main() -> None:
    results: list[Any] = run_ranks(__file__, ["--worker", *(["--quick"] if QUICK else [])], STAGES)
    rows: list[dict[str, Any]] = sorted(results, key=lambda r: int(r["stage"]))
    comm = statistics.median(r["message"] for r in rows[:2])
    walls = {name: statistics.median(v) for name, v in rows[0]["walls"].items()}
    cores = min(os.cpu_count() or 1, STAGES)
    print(
        f"zengine.pipe on CPU: {STAGES} stages x 1, {MICRO_BATCHES} micro-batches of "
        f"{MICRO}x{SEQ}, hidden {HIDDEN}, {BLOCKS} blocks, one thread per rank, "
        f"{os.cpu_count()} cores; median of {ROUNDS} batches\n"
    )
    print("stage costs, ms per micro-batch (stages 0 1 2 3):")
    tables = [
        (f"in the {label} batches", [r["times"][n] for r in rows]) for n, label in SCHEDULES.items()
    ]
    for where, per_stage in [*tables, ("each stage alone", [r["alone"] for r in rows])]:
        costs = "; ".join(
            f"{k} " + " ".join(f"{t[k] * 1e3:.1f}" for t in per_stage) for k in sorted(per_stage[0])
        )
        print(f"  {where:24} {costs}")
    print(f"  one activation message: {comm * 1e3:.2f} ms\n")
    base = walls["1f1b"]
    print(
        "| schedule | time per batch | vs zengine 1F1B | simulated, in-run costs | measured / "
        "simulated | simulated, costs alone | work alone / cores |"
    )
    print("|---|---|---|---|---|---|---|")
    alone = [r["alone"] for r in rows]
    for name, label in SCHEDULES.items():
        run = _simulate(name, [r["times"][name] for r in rows], comm)
        solo = _simulate(name, alone, comm)
        bound = sum(solo.busy) / cores
        print(
            f"| zengine {label} | {walls[name] * 1e3:.0f} ms | {walls[name] / base:.2f}x | "
            f"{run.makespan * 1e3:.0f} ms | {walls[name] / run.makespan:.3f} | "
            f"{solo.makespan * 1e3:.0f} ms | {bound * 1e3:.0f} ms |"
        )
    print(f"| {TORCH} | {walls[TORCH] * 1e3:.0f} ms | {walls[TORCH] / base:.2f}x | | | | |")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
