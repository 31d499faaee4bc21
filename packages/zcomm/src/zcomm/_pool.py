"""The pool of worker processes that `DistributedTest` runs its ranks in.

Starting a process that imports torch costs seconds; a test suite of hundreds of small
distributed tests cannot pay that per test. So the pytest process keeps workers alive and
sends each test to the first ``world_size`` of them. A worker that hangs or dies is killed and
replaced; everything else is reused until pytest exits.

[Note: hangs] The pool never waits without a deadline. When a rank fails, the others get a
short grace period (a failed rank tears its process group down, which usually makes its peers'
pending collectives fail fast instead of hang); a rank still running at the deadline gets
SIGUSR1, which makes it dump every thread's stack into its log, and is then killed. The
report names each such rank and shows its stack.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

__all__ = ["RankResult", "WorkerPool", "pool"]

_START_TIMEOUT = 300.0  # seconds for a fresh worker to import torch, on a loaded CI machine


@dataclass
class RankResult:
    """What one rank of a test came back with."""

    rank: int
    status: str  # ok | error | skip | xfail | setup | died | hung
    text: str = ""
    log: str = ""
    finished_at: float = field(default_factory=time.time)  # wall clock, comparable across ranks


class _Worker:
    def __init__(self, index: int, log_dir: Path) -> None:
        self.index = index
        self.log_path = log_dir / f"worker{index}.log"
        self.log_offset = 0
        self.live_group: int | None = None  # id of a process group kept alive in it
        parent_end, child_end = socket.socketpair()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "zcomm._worker", str(child_end.fileno())],
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_worker_env(),
            )
        child_end.close()
        self.conn = Connection(parent_end.detach())
        self.ready = False

    def read_log(self) -> str:
        """What the worker printed since the last call."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                data = f.read()
        except OSError:
            return ""
        self.log_offset += len(data)
        return data.decode("utf-8", errors="replace")

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.conn.close()


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    # The parent's sys.path reaches the worker too (tests import helpers beside them).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous of the next test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerPool:
    """Worker processes, started on demand, reused across tests, replaced when broken."""

    def __init__(self) -> None:
        self._log_dir = Path(tempfile.mkdtemp(prefix="zcomm-workers-"))
        self._workers: list[_Worker | None] = []
        self._group_ids = 0  # counter naming process groups kept alive between tests
        self._stores = 0  # counter naming rendezvous files

    def acquire(self, world_size: int) -> list[_Worker]:
        """The first `world_size` workers, started (in parallel) if missing."""
        while len(self._workers) < world_size:
            self._workers.append(None)
        for i in range(world_size):
            worker = self._workers[i]
            if worker is None or worker.proc.poll() is not None:
                self._workers[i] = _Worker(i, self._log_dir)
        workers = [w for w in self._workers[:world_size] if w is not None]
        self._wait_ready([w for w in workers if not w.ready])
        return workers

    def _wait_ready(self, starting: list[_Worker]) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        pending = {w.conn: w for w in starting}
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                logs = "\n".join(w.read_log() for w in pending.values())
                self.discard(list(pending.values()))
                raise RuntimeError(
                    f"test workers did not start within {_START_TIMEOUT:.0f} s:\n{logs}"
                )
            for conn in ready:
                worker = pending.pop(cast(Connection, conn))
                try:
                    worker.conn.recv()
                except (EOFError, OSError):
                    log = worker.read_log()
                    self.discard([worker])
                    raise RuntimeError(f"a test worker exited while starting:\n{log}") from None
                worker.ready = True
                worker.read_log()  # start-up chatter (torch warnings) is not any test's output

    def discard(self, workers: list[_Worker]) -> None:
        """Kill `workers` and forget them (the next `acquire` starts fresh ones)."""
        for worker in workers:
            worker.kill()
            if worker.index < len(self._workers) and self._workers[worker.index] is worker:
                self._workers[worker.index] = None

    def new_store_path(self) -> str:
        """A path for a fresh file store: the rendezvous of one test."""
        self._stores += 1
        return str(self._log_dir / f"rendezvous-{self._stores}")

    def new_group_id(self) -> int:
        """A fresh id for a process group that outlives its test (reuse_dist_env)."""
        self._group_ids += 1
        return self._group_ids

    def run(
        self, workers: list[_Worker], tasks: list[dict[str, Any]], *, timeout: float, grace: float
    ) -> list[RankResult]:
        """Send one task per worker and collect every rank's result (see [Note: hangs])."""
        for worker, task in zip(workers, tasks, strict=True):
            worker.conn.send(task)
        start = time.monotonic()
        deadline = start + timeout
        results: dict[int, RankResult] = {}
        pending = {w.conn: w for w in workers}
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                worker = pending.pop(cast(Connection, conn))
                results[worker.index] = self._receive(worker)
                if results[worker.index].status not in ("ok", "skip", "xfail"):
                    deadline = min(deadline, time.monotonic() + grace)
        hung = list(pending.values())
        self._dump_stacks(hung)
        for worker in hung:
            results[worker.index] = RankResult(
                worker.index, "hung", f"{time.monotonic() - start:.1f}"
            )
        self.discard(hung + [w for w in workers if results[w.index].status == "died"])
        for worker in workers:
            results[worker.index].log = worker.read_log()
        return [results[w.index] for w in workers]

    def _receive(self, worker: _Worker) -> RankResult:
        try:
            status, text, when = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.proc.wait(timeout=10)
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return RankResult(worker.index, "died", how)
        return RankResult(worker.index, status, text, finished_at=when)

    def _dump_stacks(self, workers: list[_Worker]) -> None:
        if not workers or not hasattr(signal, "SIGUSR1"):
            return
        for worker in workers:
            with contextlib.suppress(OSError):
                os.kill(worker.proc.pid, signal.SIGUSR1)
        time.sleep(0.5)  # faulthandler writes from the signal handler; give it a moment

    def shutdown(self) -> None:
        """Stop every worker and remove the logs."""
        for worker in self._workers:
            if worker is not None:
                with contextlib.suppress(OSError, BrokenPipeError):
                    worker.conn.send(None)
        for worker in self._workers:
            if worker is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(timeout=5)
                worker.kill()
        self._workers = []
        shutil.rmtree(self._log_dir, ignore_errors=True)


_pool: WorkerPool | None = None


def pool() -> WorkerPool:
    """The process-wide pool, created on first use and shut down when Python exits."""
    global _pool
    if _pool is None:
        _pool = WorkerPool()
        atexit.register(_pool.shutdown)
    return _pool
