"""zengine ZeRO-3 training step against plain PyTorch, DDP, FSDP2 and DeepSpeed ZeRO-3 on CPU.

Run by ``nox -s bench -- zengine`` (or ``python bench/bench_zengine.py [--quick]``).

The model is a GPT: token embedding (vocab 8192) + learned position embedding, 4 blocks of hidden
256 (LayerNorm, causal 4-head attention via F.scaled_dot_product_attention through one qkv Linear,
proj Linear, residual; LayerNorm, Linear 256->1024, GELU, Linear 1024->256, residual), a final
LayerNorm and a Linear head; sequence 256, micro-batch 4 per rank, cross-entropy on random
targets, fp32. A step is forward, backward and an Adam step (lr 1e-3): ``torch.optim.Adam`` for
plain PyTorch, DDP and FSDP2 (FSDP2: ``fully_shard`` per block, then the root); for zengine and
DeepSpeed the same config, ``{"optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 3}}``
with default thresholds, through ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``.
Every contender starts from the same seed and sees the same batches. One torch thread per
process, gloo throughout.

Each contender runs in its own process (world size 1) or group of processes (world size 2), so
its memory figures are its own: VmHWM (peak) and VmRSS (end of run) from /proc/self/status. The
groups wait side by side; this script tells one group at a time to run a few steps, rotating the
order every round, and takes medians of the per-step wall and CPU times and of the per-round
ratios to the reference (plain PyTorch at world size 1, DDP at world size 2).

1. World size 1: plain PyTorch (and an A/A copy of it: the harness's own noise), zengine,
   FSDP2, DeepSpeed. Target: zengine's CPU time at most 1.05x plain.
2. World size 2: DDP, zengine, FSDP2, DeepSpeed. Targets: zengine at most 1.10x DDP, and its wall
   time no worse than the faster of FSDP2 and DeepSpeed.
3. Losses of the first steps against plain PyTorch (world size 2: the mean of the ranks' losses
   against plain PyTorch on the global batch).
4. Memory: 4 blocks of hidden 1024 at world size 2, one contender at a time, RSS per rank.
   Target: zengine's end-of-run RSS at most FSDP2's, read right after the last step and again
   after 2 s at rest (zengine hands freed heap back after 1 s idle; the others never do).
   zengine twice: as configured above, and with ``host_memory_trim: step`` (the heap handed
   back after every step), each with its wall time per step at this size.
5. Threshold 0 (issue #28: ZeRO-3 at nearly no cost over data parallelism, even when every
   parameter is partitioned): zengine and DeepSpeed with ``"stage3_param_persistence_threshold":
   0``. The 48-small-block GPT (bench_zpartition.py's: vocab 256, 48 blocks of hidden 64, 4
   heads, sequence 64, micro-batch 4 per rank; its tensors are tiny, so a ZeRO-3
   implementation's per-module work is most of the step) at world size 1: plain PyTorch and
   zengine (target: zengine's CPU time at most 1.05x plain); at world size 2: DDP, zengine,
   zengine with ``"module_group_size": 0`` (a unit per module: zengine before module groups),
   FSDP2 and DeepSpeed, several times slower here and so given half the steps a round (target:
   zengine's CPU time at most 1.10x DDP). The 4-block GPT above at world size 2: DDP and
   zengine (target: CPU time at most 1.05x DDP). Then, on the 48-block GPT, each contender
   alone: Python function calls per step (cProfile; target for zengine at world size 2: at
   most 25k), and the collectives per step (torch.profiler: the c10d ops but barriers) with
   the bytes gloo was handed as their inputs, rank 0's.

A contender that cannot be built or fails is reported as "not available: <reason>" (DeepSpeed
when it is not installed); its traceback is printed at the end.
"""

from __future__ import annotations

import cProfile
import importlib
import importlib.metadata
import json
import math
import os
import pstats
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import astuple, dataclass, field, replace
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from _common import GPT, Batch, Step, engine_step, free_port, rank_env, trainer_step

VOCAB, SEQ, HEADS, BLOCKS = 8192, 256, 4, 4
HIDDEN, MICRO_BATCH = 256, 4  # the timed model
MEM_HIDDEN, MEM_SEQ, MEM_MICRO_BATCH = 1024, 128, 2  # the memory table's model
LR = 1e-3
MODEL_SEED, DATA_SEED, N_BATCHES = 0, 1, 4  # N_BATCHES distinct batches, used in turn
WORLD = 2
QUICK = "--quick" in sys.argv
# rounds, steps per contender per round, warm-up steps (their losses are the check), timed
# steps of the memory run after its warm-up
ROUNDS, STEPS, WARMUP, MEM_STEPS = (2, 2, 2, 1) if QUICK else (6, 4, 3, 3)
SLOW_STEPS = max(1, STEPS // 2)  # a round's steps for a contender several times slower
# steps under cProfile (Python calls) and under torch.profiler (collectives), each contender alone
PROFILED, TRACED = (1, 1) if QUICK else (3, 2)
TARGET_WS1, TARGET_WS2 = 1.05, 1.10  # zengine CPU / plain at ws 1; zengine / DDP at ws 2
# zengine CPU / DDP at threshold 0 on the 4-block GPT at ws 2: big tensors, where the
# per-module work is a small share of the step
TARGET_T0_BIG = 1.05
TARGET_CALLS = 25_000  # zengine's Python calls per step, threshold 0, 48 small blocks, ws 2
IDLE = 2.0  # seconds at rest after the run before the memory is read again
STARTUP_TIMEOUT = 600.0  # seconds: DeepSpeed compiles its CPU ops on its first run (minutes)
STEP_TIMEOUT = 60.0  # seconds per step before a group counts as hung


@dataclass(frozen=True)
class Shape:
    """A GPT of `blocks` blocks of width `hidden`, `vocab` tokens and `positions` learned
    positions, trained on `micro` sequences of `seq` tokens per rank."""

    blocks: int
    vocab: int
    hidden: int
    positions: int
    seq: int
    micro: int

    def gpt(self) -> GPT:
        return GPT(
            vocab=self.vocab,
            hidden=self.hidden,
            seq=self.positions,
            heads=HEADS,
            blocks=self.blocks,
        )

    def argv(self) -> list[str]:
        return [str(value) for value in astuple(self)]


MAIN = Shape(BLOCKS, VOCAB, HIDDEN, SEQ, SEQ, MICRO_BATCH)
# the memory table's model keeps the timed model's position table, shorter sequences
MEMORY_SHAPE = Shape(BLOCKS, VOCAB, MEM_HIDDEN, SEQ, MEM_SEQ, MEM_MICRO_BATCH)
# bench_zpartition.py's model: tensors so small that per-module work is most of a step
SMALL = Shape(blocks=48, vocab=256, hidden=64, positions=64, seq=64, micro=4)

PLAIN, AA, DDP, ZENGINE, FSDP, DEEPSPEED = (
    "plain PyTorch",
    "plain PyTorch (A/A copy)",
    "DDP",
    "zengine stage 3",
    "FSDP2 per block",
    "DeepSpeed ZeRO-3",
)
# zengine with the heap handed back after every step, not once idle (a zengine-only key)
ZENGINE_TRIM = "zengine stage 3, host_memory_trim: step"
# every parameter partitioned; zengine also with a unit per module (its gathers before module
# groups: module_group_size is a zengine-only key)
ZENGINE_T0 = "zengine stage 3, threshold 0"
ZENGINE_T0_MODULES = "zengine, threshold 0, a unit per module"
DEEPSPEED_T0 = "DeepSpeed ZeRO-3, threshold 0"
THRESHOLD_0 = {"stage": 3, "stage3_param_persistence_threshold": 0}
# label: the library whose initialize() builds it, and the keys added to the shared config
ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    ZENGINE: ("zengine", {}),
    ZENGINE_TRIM: ("zengine", {"host_memory_trim": "step"}),
    ZENGINE_T0: ("zengine", {"zero_optimization": THRESHOLD_0}),
    ZENGINE_T0_MODULES: ("zengine", {"zero_optimization": {**THRESHOLD_0, "module_group_size": 0}}),
    DEEPSPEED: ("deepspeed", {}),
    DEEPSPEED_T0: ("deepspeed", {"zero_optimization": THRESHOLD_0}),
}
REFERENCE = "plain PyTorch, global batch"  # world size 1 on the global batch: ws 2's reference
MEMORY = [ZENGINE, ZENGINE_TRIM, FSDP, DDP, DEEPSPEED]


@dataclass(frozen=True)
class Phase:
    """Contenders timed side by side in rotation, and what they are held to."""

    name: str  # as the list of failures names it; capitalized, the table's title
    labels: list[str]
    world: int
    shape: Shape = MAIN
    targets: dict[str, float] = field(default_factory=dict)  # label: most CPU x the reference
    wall: bool = False  # the targets hold for the wall time too, and against FSDP2/DeepSpeed's
    probe: bool = False  # then Python calls and collectives per step, each contender alone
    calls: dict[str, float] = field(default_factory=dict)  # label: most Python calls per step
    slow: list[str] = field(default_factory=list)  # labels that take SLOW_STEPS a round

    @property
    def title(self) -> str:
        return self.name[:1].upper() + self.name[1:]

    @property
    def reference(self) -> str:
        return PLAIN if self.world == 1 else DDP

    @property
    def loss_reference(self) -> str:
        return PLAIN if self.world == 1 else REFERENCE

    def steps(self, label: str) -> int:
        """Steps per round: fewer for the slow contenders, for the phase's time (their figures
        are per step, their ratios those of each round)."""
        return SLOW_STEPS if label in self.slow else STEPS


WS1 = Phase("world size 1", [PLAIN, AA, ZENGINE, FSDP, DEEPSPEED], 1, targets={ZENGINE: TARGET_WS1})
WS2 = Phase(
    f"world size {WORLD}",
    [DDP, ZENGINE, FSDP, DEEPSPEED],
    WORLD,
    targets={ZENGINE: TARGET_WS2},
    wall=True,
)
SMALL_NAME = f"{SMALL.blocks}-small-block GPT"
THRESHOLD_0_PHASES = [
    Phase(
        f"threshold 0, {SMALL_NAME}, world size 1",
        [PLAIN, ZENGINE_T0],
        1,
        SMALL,
        targets={ZENGINE_T0: TARGET_WS1},
        probe=True,
    ),
    Phase(
        f"threshold 0, {SMALL_NAME}, world size {WORLD}",
        [DDP, ZENGINE_T0, ZENGINE_T0_MODULES, FSDP, DEEPSPEED_T0],
        WORLD,
        SMALL,
        targets={ZENGINE_T0: TARGET_WS2},
        probe=True,
        calls={ZENGINE_T0: TARGET_CALLS},
        slow=[FSDP, DEEPSPEED_T0],  # their per-module work: several times DDP's step
    ),
    Phase(
        f"threshold 0, {BLOCKS}-block GPT, world size {WORLD}",
        [DDP, ZENGINE_T0],
        WORLD,
        targets={ZENGINE_T0: TARGET_T0_BIG},
    ),
]


# ---------------------------------------------------------------------------------------------
# One rank of one contender (a worker process)


Run = Callable[[int], torch.Tensor]  # takes N steps, returns the last loss


def _memory() -> dict[str, float]:
    """Peak (VmHWM) and current (VmRSS) resident memory of this process, MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                fields[name] = int(value.split()[0]) / 1024
    return {"peak": fields["VmHWM"], "end": fields["VmRSS"]}


def _engine_trainer(
    library: str, model: nn.Module, micro_batch: int, extra: dict[str, Any] | None = None
) -> Step:
    """zengine or DeepSpeed: the same config (`extra` keys added), the same loop."""
    module: Any = importlib.import_module(library)  # Any: DeepSpeed ships no type information
    initialize = getattr(module, "initialize", None)
    if initialize is None:
        raise RuntimeError(f"{library} has no initialize() yet")
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3},
        **(extra or {}),
    }
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine_step(engine)


def _build(label: str, shape: Shape) -> Step:
    torch.manual_seed(MODEL_SEED)
    model = shape.gpt()
    if label in (PLAIN, AA, REFERENCE):
        return trainer_step(model, torch.optim.Adam(model.parameters(), lr=LR))
    if label == DDP:
        ddp = nn.parallel.DistributedDataParallel(model)
        return trainer_step(ddp, torch.optim.Adam(ddp.parameters(), lr=LR))
    if label == FSDP:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return trainer_step(model, torch.optim.Adam(model.parameters(), lr=LR))
    if label in ENGINES:
        library, extra = ENGINES[label]
        return _engine_trainer(library, model, shape.micro, extra)
    raise ValueError(f"unknown contender {label!r}")


def _batches(shape: Shape, global_batch: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(DATA_SEED)
    return [
        (
            torch.randint(0, shape.vocab, (global_batch, shape.seq), generator=gen),
            torch.randint(0, shape.vocab, (global_batch, shape.seq), generator=gen),
        )
        for _ in range(N_BATCHES)
    ]


def _runner(label: str, shape: Shape) -> tuple[Run, float]:
    """Build the contender on this rank: a function that takes steps on this rank's rows of the
    batches, and the RSS (MiB) before the model was built."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if label in ENGINES:
        importlib.import_module(ENGINES[label][0])  # so that the baseline holds the imports
    baseline = _memory()["end"]
    step = _build(label, shape)
    torch.set_num_threads(1)  # in case a library changed it
    rows = slice(rank * shape.micro, (rank + 1) * shape.micro)
    batches = [(x[rows], y[rows]) for x, y in _batches(shape, shape.micro * world)]
    done = 0

    def run(steps: int) -> torch.Tensor:
        nonlocal done
        loss = torch.zeros(())
        for _ in range(steps):
            loss = step(batches[done % N_BATCHES])
            done += 1
        return loss

    return run, baseline


def _timed(run: Run, steps: int) -> dict[str, Any]:
    """``run N``: wall and CPU seconds per step."""
    dist.barrier()  # start together: one rank's lateness is not the step's time
    wall, cpu = time.perf_counter(), time.process_time()
    run(steps)
    dist.barrier()
    return {
        "wall": (time.perf_counter() - wall) / steps,
        "cpu": (time.process_time() - cpu) / steps,
    }


def _resident(run: Run) -> dict[str, Any]:
    """``memory``: peak and current RSS, and the RSS after a while at rest."""
    now = _memory()
    time.sleep(IDLE)  # then as the process holds it at rest
    return {**now, "idle": _memory()["end"]}


def _profiled(run: Run, steps: int) -> dict[str, Any]:
    """``profile N``: Python function calls per step, a count that the machine's load does not
    move (cProfile sees this thread only)."""
    profiler = cProfile.Profile()
    dist.barrier()  # the barrier's calls are not the step's
    profiler.enable()
    run(steps)
    profiler.disable()
    calls: int = pstats.Stats(profiler).total_calls  # type: ignore[attr-defined]
    return {"calls": calls / steps}


def _comms(run: Run, steps: int) -> dict[str, Any]:
    """``comms N``: collectives and bytes per step, from torch.profiler's trace."""
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        run(steps)
    with tempfile.TemporaryDirectory(prefix="bench_zengine.trace.") as tmp:
        path = os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            events: list[dict[str, Any]] = json.load(f)["traceEvents"]
    return _count_comms(events, steps)


# bytes per element of the dtypes the profiler names as a gloo collective's input type
ELEMENT_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "unsigned char": 1,
    "signed char": 1,
    "int": 4,
    "long int": 8,
    "bool": 1,
}


def _count_comms(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The c10d ops (the collectives as called, but barriers), and the bytes of what gloo was
    handed as each collective's input (its ``gloo:`` events: the work as gloo runs it, a
    reduce-scatter as an all-reduce), each per step; input types without a known size are
    counted, not sized."""
    kinds: Counter[str] = Counter()
    unknown: Counter[str] = Counter()
    sent = 0
    for event in events:
        name = event.get("name", "")
        if name.startswith("c10d::") and name != "c10d::barrier":
            kinds[name.removeprefix("c10d::")] += 1
        elif name.startswith("gloo:"):
            args = event.get("args", {})
            dims, types = args.get("Input Dims") or [[]], args.get("Input type") or ["(none)"]
            if types[0] in ELEMENT_BYTES:
                sent += math.prod(dims[0]) * ELEMENT_BYTES[types[0]]
            else:
                unknown[types[0]] += 1
    return {
        "collectives": {kind: n / steps for kind, n in kinds.items()},
        "bytes": sent / steps,
        "unknown": dict(unknown),
    }


# what a worker answers to each command but ``quit``: the command's name, then its numbers
COMMANDS: dict[str, Callable[..., dict[str, Any]]] = {
    "run": _timed,
    "profile": _profiled,
    "comms": _comms,
    "memory": _resident,
}


def _worker(label: str, shape: Shape) -> None:
    """Build the contender, take the warm-up steps, then obey the controller's commands on stdin:
    ``run N`` (N steps between barriers, answers wall and CPU seconds per step), ``profile N``,
    ``comms N``, ``memory``, ``quit``. Answers are JSON lines on the original stdout; everything
    else anyone prints in this process (DeepSpeed logs, C++ messages) goes to the log file on
    stderr."""
    channel: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(**message: object) -> None:
        channel.write(json.dumps(message) + "\n")

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        run, baseline = _runner(label, shape)
        losses = []
        for _ in range(WARMUP):
            loss = run(1).clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / dist.get_world_size())
        send(ok=True, losses=losses, baseline=baseline)
        for command in sys.stdin:
            name, *args = command.split()
            if name == "quit":
                dist.destroy_process_group()
                send(ok=True)
                return
            send(**COMMANDS[name](run, *map(int, args)))
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        send(error=reason, traceback=traceback.format_exc())
        channel.flush()
        os._exit(1)  # the other rank may be stuck in a collective; the controller kills it


# ---------------------------------------------------------------------------------------------
# The controller: groups of worker processes, one group per contender


@dataclass
class Group:
    """One contender's processes, their answers, and what became of it."""

    label: str
    procs: list[subprocess.Popen[str]]
    logs: list[str]
    answers: list[queue.Queue[dict[str, Any]]] = field(default_factory=list)
    error: str | None = None
    traceback: str = ""
    losses: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)  # per round: rank 0's seconds per step
    cpu: list[list[float]] = field(default_factory=list)  # per rank, per round
    memory: list[dict[str, float]] = field(default_factory=list)  # per rank
    calls: float | None = None  # rank 0's Python calls per step
    comms: dict[str, Any] = field(default_factory=dict)  # rank 0's collectives per step

    def ask(self, command: str | None, timeout: float) -> list[dict[str, Any]] | None:
        """Send `command` to every rank and wait for each one's answer; None (and the group
        stopped) when a rank reports an error, dies or is silent for `timeout` seconds."""
        if self.error is not None:
            return None
        if command is not None:
            for p in self.procs:
                assert p.stdin is not None
                p.stdin.write(command + "\n")
                p.stdin.flush()
        replies = []
        deadline = time.monotonic() + timeout
        for rank, answers in enumerate(self.answers):
            try:
                reply = answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.fail(f"rank {rank} gave no answer within {timeout:.0f} s ({command})")
                return None
            if "error" in reply:
                self.fail(f"rank {rank}: {reply['error']}", reply.get("traceback", ""))
                return None
            replies.append(reply)
        return replies

    def fail(self, reason: str, trace: str = "") -> None:
        self.error = reason
        if not trace:
            trace = "".join(_tail(log) for log in self.logs)
        self.traceback = trace
        self.stop()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _reader(proc: subprocess.Popen[str], answers: queue.Queue[dict[str, Any]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        answers.put(json.loads(line))
    answers.put({"error": f"process exited with code {proc.wait()}"})


def _start(label: str, world: int, logdir: str, shape: Shape) -> Group:
    port = free_port()
    group = Group(label, [], [])
    for rank in range(world):
        env = dict(rank_env(rank, world, port), OMP_NUM_THREADS="1")
        name = "".join(c if c.isalnum() else "_" for c in label)
        log = os.path.join(logdir, f"{name}.{world}.{rank}.log")
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", label, *shape.argv()],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        answers: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=_reader, args=(proc, answers), daemon=True).start()
        group.procs.append(proc)
        group.logs.append(log)
        group.answers.append(answers)
    return group


def _started(groups: list[Group]) -> None:
    """Wait for every group's first answer: built, warm-up done, the losses."""
    for g in groups:
        replies = g.ask(None, STARTUP_TIMEOUT)
        if replies is not None:
            g.losses = replies[0]["losses"]
            g.baseline = [r["baseline"] for r in replies]


def _finish(groups: list[Group]) -> None:
    for g in groups:
        replies = g.ask("memory", STEP_TIMEOUT)
        if replies is not None:
            g.memory = replies
        if g.ask("quit", STEP_TIMEOUT) is not None:
            g.stop()


def _rotate(groups: list[Group], steps: Callable[[str], int]) -> None:
    """Contenders take turns, the order rotating every round, so each round's figures share
    the machine's load; a group that fails drops out and the others go on. `steps`: a
    contender's steps per round."""
    for i in range(ROUNDS):
        for k in range(len(groups)):
            g = groups[(i + k) % len(groups)]
            n = steps(g.label)
            replies = g.ask(f"run {n}", 30 + n * STEP_TIMEOUT)
            if replies is None:
                continue
            g.wall.append(replies[0]["wall"])
            if not g.cpu:
                g.cpu = [[] for _ in replies]
            for rank, r in enumerate(replies):
                g.cpu[rank].append(r["cpu"])


def _probe(groups: list[Group]) -> None:
    """Python calls and collectives per step, rank 0's, after the timed rounds (the profilers
    slow the steps down)."""
    for g in groups:
        replies = g.ask(f"profile {PROFILED}", 30 + 3 * PROFILED * STEP_TIMEOUT)
        if replies is not None:
            g.calls = replies[0]["calls"]
        replies = g.ask(f"comms {TRACED}", 30 + 3 * TRACED * STEP_TIMEOUT)
        if replies is not None:
            g.comms = replies[0]


def _timed_phase(phase: Phase, logdir: str) -> dict[str, Group]:
    groups = [_start(x, phase.world, logdir, phase.shape) for x in phase.labels]
    extra = []
    if phase.world > 1:  # the loss check's reference: world size 1 on the global batch
        whole = replace(phase.shape, micro=phase.shape.micro * phase.world)
        extra.append(_start(REFERENCE, 1, logdir, whole))
    _started(groups + extra)
    for g in extra:
        g.ask("quit", STEP_TIMEOUT)
        g.stop()
    _rotate([g for g in groups if g.error is None], phase.steps)
    if phase.probe:
        _probe([g for g in groups if g.error is None])
    _finish(groups)
    return {g.label: g for g in groups + extra}


def _memory_phase(logdir: str) -> dict[str, Group]:
    """One contender at a time, so that each has the machine's memory to itself."""
    result = {}
    for label in MEMORY:
        g = _start(label, WORLD, logdir, MEMORY_SHAPE)
        _started([g])
        replies = g.ask(f"run {MEM_STEPS}", STARTUP_TIMEOUT)
        if replies is not None:
            g.wall.append(replies[0]["wall"])
        _finish([g])
        result[label] = g
    return result


# ---------------------------------------------------------------------------------------------
# Tables


def _paired(a: list[float], b: list[float]) -> float:
    """The median of the per-round ratios a / b."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _mean_cpu(g: Group) -> list[float]:
    """CPU seconds per step of each round, the mean over the ranks."""
    return [statistics.mean(rank[i] for rank in g.cpu) for i in range(len(g.wall))]


def _verdict(ratio: float, target: float) -> str:
    return "meets" if ratio <= target else "misses"


def _loss_diff(g: Group, reference: Group) -> str:
    if g is reference:
        return "reference"
    if g.error is not None or not g.losses:
        return ""
    if reference.error is not None or not reference.losses:
        return "no reference"
    return f"{max(abs(a - b) for a, b in zip(g.losses, reference.losses, strict=True)):.2e}"


def _mib(values: list[float]) -> str:
    return " / ".join(f"{v:.0f}" for v in values)


def _ref_name(phase: Phase) -> str:
    return "plain" if phase.world == 1 else "DDP"


def _print_timed_header(phase: Phase) -> None:
    world = phase.world
    print(
        f"### {phase.title} (gloo, micro-batch {phase.shape.micro} per rank): ms per step, "
        f"medians of {ROUNDS} rounds x {STEPS} steps"
        + (f" ({', '.join(phase.slow)}: {SLOW_STEPS})" if phase.slow else "")
        + f" in rotating order; ratios are medians of the per-round ratio to {phase.reference}; "
        "RSS in MiB"
        + (" (rank 0 / rank 1)" if world > 1 else "")
        + f"; loss: max |loss - plain PyTorch's| over the first {WARMUP} steps"
        + (" (mean of the ranks vs plain PyTorch on the global batch)" if world > 1 else "")
        + "\n"
    )
    name = _ref_name(phase)
    cpu_head = "CPU ms" if world == 1 else " | ".join(f"CPU ms rank {r}" for r in range(world))
    print(
        f"| contender | wall ms | {cpu_head} | wall / {name} | CPU / {name} | peak RSS "
        "| end RSS | loss diff | target | verdict |"
    )
    print("|---|---:|" + "---:|" * world + "---:|---:|---:|---:|---:|---|---|")


def _timed_target(
    phase: Phase, g: Group, ratios: tuple[float, float], peer: Group | None
) -> tuple[str, str]:
    """The target cell and the verdict cell of `g`'s row; `ratios`: wall and CPU to the
    reference's; `peer`: the faster of FSDP2 and DeepSpeed."""
    limit = phase.targets.get(g.label)
    if limit is None:
        return "", ""
    name = _ref_name(phase)
    wall_r, cpu_r = ratios
    target = f"CPU <= {limit}x {name}"
    verdict = f"CPU {_verdict(cpu_r, limit)}"
    if phase.wall:
        target += f", wall <= {limit}x {name}"
        verdict += f", wall {_verdict(wall_r, limit)}"
    if phase.wall and peer is not None:
        vs = _paired(g.wall, peer.wall)
        target += f", wall <= faster of FSDP2/DeepSpeed ({peer.label})"
        verdict += f", wall {vs:.3f}x of it: {_verdict(vs, 1.0)}"
    return target, verdict


def _print_timed(phase: Phase, groups: dict[str, Group]) -> None:
    _print_timed_header(phase)
    base = groups[phase.reference]
    ok = {label: g for label, g in groups.items() if g.error is None and g.wall}
    peer = min(
        (g for label, g in ok.items() if label in (FSDP, DEEPSPEED)),
        key=lambda g: statistics.median(g.wall),
        default=None,
    )
    for label, g in groups.items():
        if label == REFERENCE:
            continue
        if label not in ok:
            cells = " |" * (phase.world + 7)
            print(f"| {label} | not available: {g.error}{cells}")
            continue
        cpus = " | ".join(f"{1e3 * statistics.median(c):.1f}" for c in g.cpu)
        if base.label in ok:
            wall_r, cpu_r = _paired(g.wall, base.wall), _paired(_mean_cpu(g), _mean_cpu(base))
            ratios = f"{wall_r:.3f} | {cpu_r:.3f}"
        else:
            wall_r = cpu_r = float("nan")
            ratios = "n/a | n/a"
        target, verdict = _timed_target(phase, g, (wall_r, cpu_r), peer)
        memory = [_mib([m[key] for m in g.memory]) if g.memory else "" for key in ("peak", "end")]
        print(
            f"| {label} | {1e3 * statistics.median(g.wall):.1f} | {cpus} | {ratios} "
            f"| {memory[0]} | {memory[1]} | {_loss_diff(g, groups[phase.loss_reference])} "
            f"| {target} | {verdict} |"
        )
    print()


def _collectives_cell(comms: dict[str, Any]) -> str:
    kinds: dict[str, float] = comms["collectives"]
    if not kinds:
        return "none"
    each = ", ".join(f"{kind} {n:g}" for kind, n in sorted(kinds.items()))
    return f"{sum(kinds.values()):g} ({each})"


def _bytes_cell(comms: dict[str, Any]) -> str:
    unknown: dict[str, int] = comms["unknown"]
    cell = f"{comms['bytes'] / 2**20:.2f}"
    if unknown:  # inputs of a type without a known element size: not in the figure
        cell += " + unknown: " + ", ".join(f"{n} x {kind}" for kind, n in unknown.items())
    return cell


def _print_probes(phase: Phase, groups: dict[str, Group]) -> None:
    name, base = _ref_name(phase), groups[phase.reference]
    print(
        f"### {phase.title}: Python function calls per step (cProfile, {PROFILED} steps) and "
        f"collectives per step (torch.profiler, {TRACED} steps: the c10d ops but barriers; MiB: "
        "the inputs gloo was handed), each contender alone after the timed rounds\n"
    )
    print(
        f"| contender | Python calls per step (rank 0) | x {name} | collectives per step "
        "| MiB moved per step (rank 0) | target | verdict |"
    )
    print("|---|---:|---:|---|---:|---|---|")
    for label, g in groups.items():
        if label == REFERENCE:
            continue
        if g.calls is None or not g.comms:
            print(f"| {label} | not available: {g.error} | | | | | |")
            continue
        ratio = f"{g.calls / base.calls:.2f}" if base.calls else "n/a"
        limit = phase.calls.get(label)
        target = f"calls <= {limit / 1e3:g}k" if limit else ""
        verdict = _verdict(g.calls, limit) if limit else ""
        print(
            f"| {label} | {g.calls:,.0f} | {ratio} | {_collectives_cell(g.comms)} "
            f"| {_bytes_cell(g.comms)} | {target} | {verdict} |"
        )
    print()


def _print_memory(groups: dict[str, Group]) -> None:
    params = sum(p.numel() for p in MEMORY_SHAPE.gpt().parameters())
    print(
        f"### Memory: {BLOCKS} blocks of hidden {MEM_HIDDEN} ({params / 1e6:.1f} M parameters, "
        f"fp32, Adam), world size {WORLD}, sequence {MEM_SEQ}, micro-batch {MEM_MICRO_BATCH}, "
        f"{WARMUP} steps, then {MEM_STEPS} timed (wall ms per step, their mean; each contender "
        "alone, so a time to set against the memory, not a benchmark); MiB per rank (rank 0 / "
        "rank 1); baseline is the RSS after imports and process-group start, before the model "
        "is built\n"
    )
    print(
        f"| contender | wall ms | baseline RSS | peak RSS | end-of-run RSS | after {IDLE:g} s "
        "at rest | target | verdict |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|")
    fsdp = groups.get(FSDP)
    for label, g in groups.items():
        if g.error is not None or not g.memory:
            print(f"| {label} | not available: {g.error} | | | | | | |")
            continue
        target = verdict = ""
        if label in (ZENGINE, ZENGINE_TRIM):
            target = "end RSS <= FSDP2's, each rank"
            if fsdp is not None and fsdp.memory:
                verdict = ", ".join(
                    f"{when}: {_verdict_memory(g, fsdp, key)}"
                    for when, key in (("right after", "end"), ("at rest", "idle"))
                )
            else:
                verdict = "no FSDP2 figure"
        wall = f"{1e3 * g.wall[0]:.0f}" if g.wall else ""
        print(
            f"| {label} | {wall} | {_mib(g.baseline)} | {_mib([m['peak'] for m in g.memory])} "
            f"| {_mib([m['end'] for m in g.memory])} | {_mib([m['idle'] for m in g.memory])} "
            f"| {target} | {verdict} |"
        )
    print()


def _verdict_memory(g: Group, reference: Group, key: str) -> str:
    ok = all(a[key] <= b[key] for a, b in zip(g.memory, reference.memory, strict=True))
    return "meets" if ok else "misses"


def _print_failures(phases: list[tuple[str, dict[str, Group]]]) -> None:
    """Each distinct failure once, with the phases it happened in and its traceback."""
    seen: dict[tuple[str, str], tuple[list[str], str]] = {}
    for name, groups in phases:
        for g in groups.values():
            if g.error:
                seen.setdefault((g.label, g.error), ([], g.traceback))[0].append(name)
    if seen:
        print("### Failures\n")
    for (label, error), (names, trace) in seen.items():
        tail = "\n".join(trace.strip().splitlines()[-30:])
        print(f"{label} ({', '.join(names)}): {error}\n\n```\n{tail}\n```\n")


def _print_threshold_0(results: list[tuple[Phase, dict[str, Group]]]) -> None:
    small = SMALL.gpt()
    params = sum(p.numel() for p in small.parameters())
    print(
        "## Threshold 0 (issue #28: ZeRO-3 at nearly no cost over data parallelism, even when "
        'every parameter is partitioned): `"stage3_param_persistence_threshold": 0` for zengine '
        f"and DeepSpeed; the {SMALL_NAME} ({SMALL.blocks} blocks of hidden {SMALL.hidden}, "
        f"vocab {SMALL.vocab}, sequence {SMALL.seq}: {params / 1e6:.2f} M parameters in "
        f"{len(list(small.parameters()))} tensors) and the {BLOCKS}-block GPT above; "
        f'"{ZENGINE_T0_MODULES}": `"module_group_size": 0`, zengine before module groups\n'
    )
    for phase, groups in results:
        _print_timed(phase, groups)
    for phase, groups in results:
        if phase.probe:
            _print_probes(phase, groups)


def main() -> None:
    """Measure everything and print the tables."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_zengine.") as logdir:
        timed = [(phase, _timed_phase(phase, logdir)) for phase in (WS1, WS2)]
        memory = _memory_phase(logdir)
        threshold_0 = [(phase, _timed_phase(phase, logdir)) for phase in THRESHOLD_0_PHASES]
    try:
        deepspeed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed = "not installed"
    params = sum(p.numel() for p in MAIN.gpt().parameters())
    print(
        f"## zengine ZeRO-3 vs plain PyTorch, DDP, FSDP2 and DeepSpeed: {BLOCKS}-block GPT, "
        f"hidden {HIDDEN}, sequence {SEQ}, vocab {VOCAB} ({params / 1e6:.1f} M parameters), "
        f"micro-batch {MICRO_BATCH}, Adam, fp32; torch {torch.__version__}, DeepSpeed "
        f"{deepspeed}, {os.cpu_count()} CPUs, 1 torch thread per process"
        f"{' (--quick)' if QUICK else ''}\n"
    )
    for phase, groups in timed:
        _print_timed(phase, groups)
    _print_memory(memory)
    _print_threshold_0(threshold_0)
    _print_failures(
        [(phase.name, groups) for phase, groups in timed]
        + [("memory", memory)]
        + [(phase.name, groups) for phase, groups in threshold_0]
    )
    plain = timed[0][1][PLAIN]
    if plain.losses:
        print(f"plain PyTorch's losses: {', '.join(f'{x:.6f}' for x in plain.losses)}")
    print(f"\nwhole benchmark: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        at = sys.argv.index("--worker")
        _worker(sys.argv[at + 1], Shape(*map(int, sys.argv[at + 2 : at + 8])))
    else:
        main()
