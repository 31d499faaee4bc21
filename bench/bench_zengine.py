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

A contender that cannot be built or fails is reported as "not available: <reason>" (DeepSpeed
when it is not installed); its traceback is printed at the end.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from _common import GPT, free_port, rank_env

VOCAB, SEQ, HEADS, BLOCKS = 8192, 256, 4, 4
HIDDEN, MICRO_BATCH = 256, 4  # the timed model
MEM_HIDDEN, MEM_SEQ, MEM_MICRO_BATCH = 1024, 128, 2  # the memory table's model
LR = 1e-3
MODEL_SEED, DATA_SEED, N_BATCHES = 0, 1, 4  # N_BATCHES distinct batches, used in turn
WORLD = 2
QUICK = "--quick" in sys.argv
# rounds, steps per contender per round, warm-up steps (their losses are the check), steps of
# the memory run
# rounds, steps per contender per round, warm-up steps (their losses are the check), timed
# steps of the memory run after its warm-up
ROUNDS, STEPS, WARMUP, MEM_STEPS = (2, 2, 2, 1) if QUICK else (6, 4, 3, 3)
TARGET_WS1, TARGET_WS2 = 1.05, 1.10  # zengine CPU / plain at ws 1; zengine / DDP at ws 2
IDLE = 2.0  # seconds at rest after the run before the memory is read again
STARTUP_TIMEOUT = 600.0  # seconds: DeepSpeed compiles its CPU ops on its first run (minutes)
STEP_TIMEOUT = 60.0  # seconds per step before a group counts as hung

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
ZENGINES = {ZENGINE: {}, ZENGINE_TRIM: {"host_memory_trim": "step"}}
REFERENCE = "plain PyTorch, global batch"  # world size 1 on the global batch: ws 2's reference
WS1 = [PLAIN, AA, ZENGINE, FSDP, DEEPSPEED]
WS2 = [DDP, ZENGINE, FSDP, DEEPSPEED]
MEMORY = [ZENGINE, ZENGINE_TRIM, FSDP, DDP, DEEPSPEED]


# ---------------------------------------------------------------------------------------------
# One rank of one contender (a worker process)


def _gpt(hidden: int) -> GPT:
    return GPT(vocab=VOCAB, hidden=hidden, seq=SEQ, heads=HEADS, blocks=BLOCKS)


Batch = tuple[torch.Tensor, torch.Tensor]
Step = Callable[[Batch], torch.Tensor]


def _memory() -> dict[str, float]:
    """Peak (VmHWM) and current (VmRSS) resident memory of this process, MiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                fields[name] = int(value.split()[0]) / 1024
    return {"peak": fields["VmHWM"], "end": fields["VmRSS"]}


def _trainer(model: nn.Module, optimizer: torch.optim.Optimizer) -> Step:
    def step(batch: Batch) -> torch.Tensor:
        loss: torch.Tensor = model(*batch)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


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

    def step(batch: Batch) -> torch.Tensor:
        loss: torch.Tensor = engine(*batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _build(label: str, hidden: int, micro_batch: int) -> Step:
    torch.manual_seed(MODEL_SEED)
    model = _gpt(hidden)
    if label in (PLAIN, AA, REFERENCE):
        return _trainer(model, torch.optim.Adam(model.parameters(), lr=LR))
    if label == DDP:
        ddp = nn.parallel.DistributedDataParallel(model)
        return _trainer(ddp, torch.optim.Adam(ddp.parameters(), lr=LR))
    if label == FSDP:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return _trainer(model, torch.optim.Adam(model.parameters(), lr=LR))
    if label in ZENGINES:
        return _engine_trainer("zengine", model, micro_batch, ZENGINES[label])
    if label == DEEPSPEED:
        return _engine_trainer("deepspeed", model, micro_batch)
    raise ValueError(f"unknown contender {label!r}")


def _batches(seq: int, global_batch: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(DATA_SEED)
    return [
        (
            torch.randint(0, VOCAB, (global_batch, seq), generator=gen),
            torch.randint(0, VOCAB, (global_batch, seq), generator=gen),
        )
        for _ in range(N_BATCHES)
    ]


def _worker(label: str, hidden: int, seq: int, micro_batch: int) -> None:
    """Build the contender, take the warm-up steps, then obey the controller's commands on stdin:
    ``run N`` (N steps between barriers, answers wall and CPU seconds per step), ``memory``,
    ``quit``. Answers are JSON lines on the original stdout; everything else anyone prints in
    this process (DeepSpeed logs, C++ messages) goes to the log file on stderr."""
    channel: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(**message: object) -> None:
        channel.write(json.dumps(message) + "\n")

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        library = "zengine" if label in ZENGINES else "deepspeed" if label == DEEPSPEED else None
        if library is not None:
            importlib.import_module(library)  # so that the baseline holds the imports
        baseline = _memory()["end"]
        step = _build(label, hidden, micro_batch)
        torch.set_num_threads(1)  # in case a library changed it
        rows = slice(rank * micro_batch, (rank + 1) * micro_batch)
        batches = [(x[rows], y[rows]) for x, y in _batches(seq, micro_batch * world)]
        done = 0

        def run(steps: int) -> torch.Tensor:
            nonlocal done
            loss = torch.zeros(())
            for _ in range(steps):
                loss = step(batches[done % N_BATCHES])
                done += 1
            return loss

        losses = []
        for _ in range(WARMUP):
            loss = run(1).clone()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        send(ok=True, losses=losses, baseline=baseline)
        for command in sys.stdin:
            name, *args = command.split()
            if name == "run":
                steps = int(args[0])
                dist.barrier()  # start together: one rank's lateness is not the step's time
                wall, cpu = time.perf_counter(), time.process_time()
                run(steps)
                dist.barrier()
                send(
                    wall=(time.perf_counter() - wall) / steps,
                    cpu=(time.process_time() - cpu) / steps,
                )
            elif name == "memory":
                now = _memory()
                time.sleep(IDLE)  # then as the process holds it at rest
                send(**now, idle=_memory()["end"])
            elif name == "quit":
                dist.destroy_process_group()
                send(ok=True)
                return
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


def _start(label: str, world: int, logdir: str, hidden: int, seq: int, micro: int) -> Group:
    port = free_port()
    group = Group(label, [], [])
    for rank in range(world):
        env = dict(rank_env(rank, world, port), OMP_NUM_THREADS="1")
        name = "".join(c if c.isalnum() else "_" for c in label)
        log = os.path.join(logdir, f"{name}.{world}.{rank}.log")
        args = ["--worker", label, str(hidden), str(seq), str(micro)]
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, __file__, *args],
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


def _rotate(groups: list[Group], steps: int) -> None:
    """Contenders take turns, the order rotating every round, so each round's figures share
    the machine's load; a group that fails drops out and the others go on."""
    for i in range(ROUNDS):
        for k in range(len(groups)):
            g = groups[(i + k) % len(groups)]
            replies = g.ask(f"run {steps}", 30 + steps * STEP_TIMEOUT)
            if replies is None:
                continue
            g.wall.append(replies[0]["wall"])
            if not g.cpu:
                g.cpu = [[] for _ in replies]
            for rank, r in enumerate(replies):
                g.cpu[rank].append(r["cpu"])


def _timed_phase(labels: list[str], world: int, logdir: str) -> dict[str, Group]:
    groups = [_start(x, world, logdir, HIDDEN, SEQ, MICRO_BATCH) for x in labels]
    extra = [_start(REFERENCE, 1, logdir, HIDDEN, SEQ, MICRO_BATCH * WORLD)] if world > 1 else []
    _started(groups + extra)
    for g in extra:
        g.ask("quit", STEP_TIMEOUT)
        g.stop()
    _rotate([g for g in groups if g.error is None], STEPS)
    _finish(groups)
    return {g.label: g for g in groups + extra}


def _memory_phase(logdir: str) -> dict[str, Group]:
    """One contender at a time, so that each has the machine's memory to itself."""
    result = {}
    for label in MEMORY:
        g = _start(label, WORLD, logdir, MEM_HIDDEN, MEM_SEQ, MEM_MICRO_BATCH)
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


def _print_timed(groups: dict[str, Group], world: int, reference: str, loss_ref: str) -> None:
    base = groups[reference]
    ok = {label: g for label, g in groups.items() if g.error is None and g.wall}
    name = "plain" if world == 1 else "DDP"
    print(
        f"### World size {world} (gloo, micro-batch {MICRO_BATCH} per rank): ms per step, "
        f"medians of {ROUNDS} rounds x {STEPS} steps in rotating order; ratios are medians of "
        f"the per-round ratio to {reference}; RSS in MiB"
        + (" (rank 0 / rank 1)" if world > 1 else "")
        + f"; loss: max |loss - plain PyTorch's| over the first {WARMUP} steps"
        + (" (mean of the ranks vs plain PyTorch on the global batch)" if world > 1 else "")
        + "\n"
    )
    cpu_head = "CPU ms" if world == 1 else " | ".join(f"CPU ms rank {r}" for r in range(world))
    print(
        f"| contender | wall ms | {cpu_head} | wall / {name} | CPU / {name} | peak RSS "
        "| end RSS | loss diff | target | verdict |"
    )
    print("|---|---:|" + "---:|" * world + "---:|---:|---:|---:|---:|---|---|")
    faster_peer = min(
        (g for label, g in ok.items() if label in (FSDP, DEEPSPEED)),
        key=lambda g: statistics.median(g.wall),
        default=None,
    )
    for label, g in groups.items():
        if label == REFERENCE:
            continue
        if label not in ok:
            cells = " |" * (world + 7)
            print(f"| {label} | not available: {g.error}{cells}")
            continue
        cpus = " | ".join(f"{1e3 * statistics.median(c):.1f}" for c in g.cpu)
        if base.label in ok:
            wall_r, cpu_r = _paired(g.wall, base.wall), _paired(_mean_cpu(g), _mean_cpu(base))
            ratios = f"{wall_r:.3f} | {cpu_r:.3f}"
        else:
            wall_r = cpu_r = float("nan")
            ratios = "n/a | n/a"
        target = verdict = ""
        if label == ZENGINE:
            limit = TARGET_WS1 if world == 1 else TARGET_WS2
            target = f"CPU <= {limit}x {name}"
            verdict = f"CPU {_verdict(cpu_r, limit)}"
            if world > 1:
                target += f", wall <= {TARGET_WS2}x {name}"
                verdict += f", wall {_verdict(wall_r, limit)}"
            if world > 1 and faster_peer is not None:
                vs = _paired(g.wall, faster_peer.wall)
                target += f", wall <= faster of FSDP2/DeepSpeed ({faster_peer.label})"
                verdict += f", wall {vs:.3f}x of it: {_verdict(vs, 1.0)}"
        memory = [_mib([m[key] for m in g.memory]) if g.memory else "" for key in ("peak", "end")]
        print(
            f"| {label} | {1e3 * statistics.median(g.wall):.1f} | {cpus} | {ratios} "
            f"| {memory[0]} | {memory[1]} | {_loss_diff(g, groups[loss_ref])} | {target} "
            f"| {verdict} |"
        )
    print()


def _print_memory(groups: dict[str, Group]) -> None:
    params = sum(p.numel() for p in _gpt(MEM_HIDDEN).parameters())
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
        if label in ZENGINES:
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


def main() -> None:
    """Measure everything and print the tables."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_zengine.") as logdir:
        ws1 = _timed_phase(WS1, 1, logdir)
        ws2 = _timed_phase(WS2, WORLD, logdir)
        memory = _memory_phase(logdir)
    try:
        deepspeed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        deepspeed = "not installed"
    params = sum(p.numel() for p in _gpt(HIDDEN).parameters())
    print(
        f"## zengine ZeRO-3 vs plain PyTorch, DDP, FSDP2 and DeepSpeed: {BLOCKS}-block GPT, "
        f"hidden {HIDDEN}, sequence {SEQ}, vocab {VOCAB} ({params / 1e6:.1f} M parameters), "
        f"micro-batch {MICRO_BATCH}, Adam, fp32; torch {torch.__version__}, DeepSpeed "
        f"{deepspeed}, {os.cpu_count()} CPUs, 1 torch thread per process"
        f"{' (--quick)' if QUICK else ''}\n"
    )
    _print_timed(ws1, 1, PLAIN, PLAIN)
    _print_timed(ws2, WORLD, DDP, REFERENCE)
    _print_memory(memory)
    _print_failures([("world size 1", ws1), (f"world size {WORLD}", ws2), ("memory", memory)])
    if ws1[PLAIN].losses:
        print(f"plain PyTorch's losses: {', '.join(f'{x:.6f}' for x in ws1[PLAIN].losses)}")
    print(f"\nwhole benchmark: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        at = sys.argv.index("--worker")
        label, hidden, seq, micro = sys.argv[at + 1 : at + 5]
        _worker(label, int(hidden), int(seq), int(micro))
    else:
        main()
