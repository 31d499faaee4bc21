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
from pathlib import Path

import pytest
import torch

import zengine
import zoffload
from zcomm.testing import DistributedTest
from zengine._offload import IdleTrimmer, zero_releasing_pages

from ._helpers import TinyGPT, global_batches

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


_RSS_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from zengine._offload._host_memory import IdleTrimmer
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) >> 10
    trimmer = IdleTrimmer(after=float(sys.argv[1]))  # what an engine on CPU makes
    chunks = [torch.ones(1 << 18) for _ in range(256)]  # 256 MiB in 1 MiB tensors
    held = rss()
    del chunks
    freed = rss()
    trimmer.idle()
    end = time.monotonic() + 10
    while trimmer.trims == 0 and time.monotonic() < end:
        time.sleep(0.01)
    print(held, freed, rss(), trimmer.trims)
    """
)


def _rss_after_free(env: dict[str, str] | None = None) -> tuple[int, int, int, int]:
    """In a fresh process: MiB resident with 256 MiB of tensors, right after freeing them,
    after an idle spell; and how many trims ran."""
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, "0.3"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, **(env or {})},
    )
    held, freed, rested, trims = map(int, out.stdout.split())
    return held, freed, rested, trims


@needs_glibc
def test_freed_memory_stays_for_the_next_step_and_leaves_when_idle() -> None:
    held, freed, rested, trims = _rss_after_free()
    assert freed >= held - 16, (held, freed)  # free() kept it: no faults at the next step
    assert trims == 1
    assert freed - rested >= 200, (freed, rested)  # the idle trim handed it back


@needs_glibc
def test_a_users_malloc_settings_are_kept() -> None:
    # MALLOC_TRIM_THRESHOLD_ set (glibc then keeps its 128 KiB mmap threshold): each 1 MiB
    # tensor is its own mapping, returned by free() itself
    held, freed, _, _ = _rss_after_free({"MALLOC_TRIM_THRESHOLD_": str(1 << 20)})
    assert held - freed >= 200, (held, freed)


_ORDER_SCRIPT = textwrap.dedent(
    """
    import sys, torch, zpartition
    from zengine._offload._host_memory import IdleTrimmer
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) >> 10
    trimmers = []
    for step in sys.argv[1].split(","):
        if step == "init":  # a model built on the host: Init fixes the mmap threshold low
            with zpartition.Init(remote_device="cpu"):
                pass
        else:  # an engine built on CPU
            trimmers.append(IdleTrimmer(after=60.0))
    chunks = [torch.ones(1 << 18) for _ in range(256)]  # 256 MiB in 1 MiB tensors
    held = rss()
    del chunks
    print(held - rss())
    """
)


@needs_glibc
@pytest.mark.parametrize("order", ["init,engine", "engine,init,engine"])
def test_an_engine_built_after_init_holds_the_heap(order: str) -> None:
    """zpartition's Init fixes glibc's mmap threshold at 128 KiB for the construction; an engine
    built after it raises it again, so the training steps' blocks stay in the heap."""
    out = subprocess.run(
        [sys.executable, "-c", _ORDER_SCRIPT, order],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    returned = int(out.stdout.split()[-1])
    assert returned <= 16, f"{returned} MiB handed back at free(): the hold was undone"


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


class TestTrimPolicy(DistributedTest):
    @needs_glibc
    @pytest.mark.parametrize("world_size", [1, 2])
    def test_step_trims_after_every_step_and_off_never(self, world_size: int) -> None:
        tokens = global_batches(1, 2)[0]
        trims = {}
        for policy in ("step", "off"):
            torch.manual_seed(0)
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3},
                "host_memory_trim": policy,
            }
            engine, *_ = zengine.initialize(model=TinyGPT(), config=config)
            trimmer = engine._idle_trim
            for _ in range(3):
                engine.backward(engine(tokens))
                engine.step()
                assert trimmer._deadline is None  # nothing is left for the idle thread
            with torch.no_grad():
                engine(tokens)  # an evaluation still waits for idleness
            trims[policy] = trimmer.trims, trimmer._thread is not None
            engine.destroy()
        assert trims["step"][0] >= 3  # one after each step (the evaluation's may follow)
        assert trims["off"] == (0, False)


class TestStagingBuffers(DistributedTest):
    world_size = 1

    @needs_glibc
    def test_an_idle_engine_gives_back_nvme_staging_buffers(self, tmp_path: Path) -> None:
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
            },
        }
        engine, *_ = zengine.initialize(model=TinyGPT(), config=config)
        tokens = global_batches(1, 2)[0]
        for _ in range(2):
            engine.backward(engine(tokens))
            engine.step()
        engine.optimizer.swapper.wait()  # the state's write is done: its buffers are free
        held = zoffload.default_pool().stats().reserved_bytes
        assert held > 0
        trimmer = engine._idle_trim
        assert _wait_for(lambda: trimmer.trims >= 1)
        assert zoffload.default_pool().stats().reserved_bytes < held
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


def _resident_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.skipif(not GLIBC or not Path("/proc/self/status").exists(), reason="Linux, glibc")
def test_a_large_buffer_is_zeroed_by_handing_its_pages_back() -> None:
    big = torch.ones(96 << 18)  # 96 MiB of fp32: mmapped, above glibc's threshold
    inner = big[3:-5]  # neither end on a page boundary
    view = inner[1000:2000]  # a view taken before stays valid
    before = _resident_mib()
    zero_releasing_pages(inner)
    assert before - _resident_mib() > 64  # the whole pages went back, unwritten
    assert not bool(inner.any())
    assert not bool(view.any())
    assert big[:3].eq(1).all()  # the bytes either side are the caller's, untouched
    assert big[-5:].eq(1).all()
    inner.add_(2)  # written again: the kernel supplies zeroed pages
    assert bool(inner.eq(2).all())
    assert _resident_mib() - before > -8


def test_a_small_or_shared_buffer_is_zeroed_in_place() -> None:
    small = torch.ones(1000)
    zero_releasing_pages(small)
    assert not bool(small.any())
    shared = torch.ones(10 << 20).share_memory_()  # 40 MiB, but another process may read it
    zero_releasing_pages(shared)
    assert not bool(shared.any())
