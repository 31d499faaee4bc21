"""Progress: one line per ``steps_per_print`` steps on rank 0, and the time breakdown.

The line says the step, the mean loss since the last line, the learning rate, the loss scale,
samples per second and the peak memory (the accelerator's allocator peak on a GPU, the process's
peak resident memory on CPU). With ``wall_clock_breakdown`` a table of forward, backward, step
and communication time per step follows it, and the bytes this rank moved per step within a
node and across nodes (`zcomm.comm_bytes_by_link`). Losses are summed on the device until printed,
so training does not wait on a device-to-host copy every step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

import zcomm
from zengine._config import EngineConfig

__all__ = ["Progress", "Stepping", "peak_memory_bytes"]

log = logging.getLogger("zengine")
if not log.handlers:  # like DeepSpeed's logger: progress shows without logging set up
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[zengine] %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def peak_memory_bytes() -> int:
    """The accelerator allocator's peak on CUDA; the process's peak resident set on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return int(torch.cuda.max_memory_allocated())
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class _Scaled(Protocol):
    @property
    def cur_scale(self) -> float: ...  # the fp16 loss scale (1.0 without)


@runtime_checkable
class Stepping(Protocol):
    """What the progress line reads of an engine (`zengine.Engine` is one): progress sits
    below the engine and never imports it."""

    @property
    def global_steps(self) -> int: ...
    @property
    def global_samples(self) -> int: ...
    @property
    def optimizer(self) -> _Scaled | None: ...

    def get_lr(self) -> list[float]: ...


class Progress:
    """Timers and the progress line of one engine."""

    def __init__(self, engine: Stepping, config: EngineConfig) -> None:
        self.engine = engine
        self.every: int | float = config.steps_per_print  # inf: never
        self.breakdown = bool(config.wall_clock_breakdown)
        self.times: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.loss_sum: torch.Tensor | None = None  # since the last line, on the device
        self.loss_count = 0
        self.since = time.perf_counter()
        self.samples_since = 0
        if self.breakdown:
            zcomm.enable_comm_accounting()

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        if not self.breakdown:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] += time.perf_counter() - start

    def record_loss(self, loss: torch.Tensor) -> None:
        value = loss.detach().float()
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
        self.loss_count += 1

    def after_step(self) -> None:
        engine = self.engine
        if engine.global_steps % self.every:
            return
        now = time.perf_counter()
        samples = engine.global_samples - self.samples_since
        rate = samples / max(now - self.since, 1e-9)
        loss = self.loss_sum.item() / self.loss_count if self.loss_sum is not None else 0.0
        self.loss_sum, self.loss_count = None, 0
        self.since, self.samples_since = now, engine.global_samples
        if zcomm.get_rank() == 0:
            lr = ", ".join(f"{x:.3e}" for x in engine.get_lr())
            log.info(
                "step=%d loss=%.4f lr=[%s] loss_scale=%g samples/s=%.1f peak_mem=%.1f MiB",
                engine.global_steps,
                loss,
                lr,
                engine.optimizer.cur_scale if engine.optimizer is not None else 1.0,
                rate,
                peak_memory_bytes() / 2**20,
            )
        if self.breakdown:
            self._print_breakdown()

    def _print_breakdown(self) -> None:
        steps = self.every
        comm = sum(s.seconds for s in zcomm.comm_summary().values())
        links = zcomm.comm_bytes_by_link()  # this rank's, by link class (zcomm's node layout)
        zcomm.reset_comm_accounting()
        if zcomm.get_rank() == 0:
            parts = {**self.times, "communication": comm}
            table = " | ".join(f"{k} {v / steps * 1e3:.2f} ms" for k, v in parts.items())
            log.info("time per step: %s", table)
            moved = " | ".join(f"{k} {v / steps / 2**20:.2f} MiB" for k, v in links.items())
            log.info("bytes per step: %s", moved)
        self.times = dict.fromkeys(self.times, 0.0)
