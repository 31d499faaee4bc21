"""The heap goes back to the system when the engine sits idle after a step, not while it
trains ([Note: returning memory on CPU])."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zengine
from zcomm.testing import DistributedTest
from zengine._host_memory import IdleTrimmer

from ._models import TinyGPT, global_batches

try:
    ctypes.CDLL(None).malloc_trim  # noqa: B018
    GLIBC = True
except (AttributeError, OSError):
    GLIBC = False

needs_glibc = pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")


def _wait_for(condition: object, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@needs_glibc
def test_an_idle_engine_trims_once() -> None:
    trimmer = IdleTrimmer(after=0.05, above=0)
    trimmer.idle()
    assert _wait_for(lambda: trimmer.trims == 1)
    time.sleep(0.2)
    assert trimmer.trims == 1  # once per idle spell, not again and again
    trimmer.idle()
    assert _wait_for(lambda: trimmer.trims == 2)
    trimmer.close()


@needs_glibc
def test_work_starting_within_the_delay_keeps_the_heap() -> None:
    trimmer = IdleTrimmer(after=0.5, above=0)
    for _ in range(5):  # a training loop: each step's forward comes at once
        trimmer.idle()
        trimmer.busy()
    time.sleep(0.8)
    assert trimmer.trims == 0
    trimmer.close()


@needs_glibc
def test_a_closed_trimmer_stops_its_thread() -> None:
    trimmer = IdleTrimmer(after=10.0, above=0)
    trimmer.idle()
    thread = trimmer._thread
    assert thread is not None
    assert thread.is_alive()
    trimmer.close()
    thread.join(5)
    assert not thread.is_alive()
    assert trimmer.trims == 0


@needs_glibc
def test_the_freed_heap_leaves_the_resident_set() -> None:
    # In a fresh process: 256 MiB of 1 MiB tensors in the heap, freed, then an idle spell.
    # glibc's thresholds are held where a long run drifts them: large blocks in the heap,
    # free() not trimming.
    script = textwrap.dedent(
        """
        import ctypes, time, torch
        from zengine._host_memory import IdleTrimmer
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() keeps the heap's top
        def rss():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) >> 10
        chunks = [torch.ones(1 << 18) for _ in range(256)]
        del chunks
        freed = rss()
        trimmer = IdleTrimmer(after=0.05)
        trimmer.idle()
        end = time.monotonic() + 10
        while trimmer.trims == 0 and time.monotonic() < end:
            time.sleep(0.01)
        print(freed, rss(), trimmer.trims)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    before, after, trims = map(int, out.stdout.split())
    assert trims == 1
    assert before - after >= 200, (before, after)


def test_a_disabled_trimmer_starts_nothing() -> None:
    trimmer = IdleTrimmer(after=0.01, above=0, enabled=False)  # an engine on a GPU
    trimmer.idle()
    time.sleep(0.1)
    assert trimmer._thread is None
    assert trimmer.trims == 0


class TestEngineIdle(DistributedTest):
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_a_step_or_an_evaluation_arms_the_trim_and_training_disarms_it(
        self, world_size: int
    ) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3},
        }
        engine, *_ = zengine.initialize(model=model, config=config)
        trimmer = engine._idle_trim
        tokens = global_batches(1, 2)[0]
        armed = lambda: trimmer._deadline is not None  # noqa: E731
        loss = engine(tokens)
        assert not armed()
        engine.backward(loss)
        engine.step()
        assert armed()  # the loop may be over: give the heap back if nothing comes
        engine.backward(engine(tokens))
        assert not armed()  # it was not: the next forward came at once
        engine.step()
        with torch.no_grad():
            engine(tokens)
        assert armed()  # an evaluation has no backward to wait for
        engine.destroy()


@needs_glibc
def test_a_forked_child_trims_on_its_own() -> None:
    trimmer = IdleTrimmer(after=0.05, above=0)
    trimmer.idle()
    with trimmer._wake:  # the parent's thread holds the lock while the fork happens
        pid = os.fork()
        if pid == 0:  # the child: a fresh lock and a thread of its own
            signal.alarm(10)  # a child stuck on the inherited lock dies instead of hanging
            trimmer.idle()
            ok = _wait_for(lambda: trimmer.trims >= 1, seconds=5)
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status)
    assert os.WEXITSTATUS(status) == 0
    trimmer.close()
