"""Off the happy path, side by side: what a user of zstack and of DeepSpeed sees when a
checkpoint holds code or damage, ranks fall out of step, a disk is full or read-only, or an
edit would be lost, and how long until they see it.

Run by ``nox -s bench -- failures`` (or ``python bench/bench_failures.py [case ...]``, with
``ZSTACK_PYTHON``/``ZSTACK_COMPAT`` and ``DEEPSPEED_PYTHON`` naming the interpreters whose
``import deepspeed`` is zstack's compatibility package and DeepSpeed itself; by default this
interpreter for both, with ``ZSTACK_COMPAT`` first on the path for zstack, as the nox session
sets it). Each case (bench/_failure_cases.py, written once against DeepSpeed's API) runs at
world size 2 over gloo on CPU, tiny model (zengine's DeepSpeed fixture model), ROUNDS times per
engine. "Time to error" is the median, over rounds, of the time from the moment the ranks
diverge to the last rank's error; a case still running after LIMIT seconds is killed and
reported as a hang. The NVMe cases mount small tmpfs folders and need root (CAP_SYS_ADMIN);
without it they are reported as not run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import free_port, rank_env

BENCH = Path(__file__).resolve().parent
FIXTURE = BENCH.parent / "packages/zengine/tests/deepspeed_checkpoints/fixtures/stage3_fp32_ws2"
LIMIT = float(os.environ.get("FAILURES_LIMIT", "90"))
ROUNDS = int(os.environ.get("FAILURES_ROUNDS", "3"))
WORLD = 2
STOPPED = {"frozen_rank": 1}  # the rank a case stops with SIGSTOP


class Payload:
    """Unpickling it creates the file `marker` (the same reduce as _failure_cases.Payload)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


def _plant(work: Path) -> None:
    """A copy of a checkpoint DeepSpeed wrote, its model-states file carrying a payload."""
    shutil.copytree(FIXTURE, work / "planted")
    for states in (work / "planted").glob("global_step3/*model_states.pt"):
        # our own fixture, read to plant the payload: trusted
        state = torch.load(states, weights_only=False)
        state["payload"] = Payload(str(work / "ran"))
        torch.save(state, states)


def _mount(folder: Path, options: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True
    )
    return done.returncode == 0


def _prepare(case: str, work: Path) -> str | None:
    """Set `work` up for `case`; the reason it cannot run here, or None."""
    if case.startswith("planted"):
        _plant(work)
    if case == "nvme_full_disk":
        (work / "big").mkdir()
        if not _mount(work / "small", "size=4k"):
            return "mounting a tmpfs needs root"
    if case == "nvme_read_only" and not _mount(work / "readonly", "ro,size=1m"):
        return "mounting a tmpfs needs root"
    return None


def _unmount(work: Path) -> None:
    for name in ("small", "readonly"):
        if (work / name).is_mount():
            subprocess.run(["umount", "-l", str(work / name)], check=False)


def _interpreters() -> dict[str, tuple[str, dict[str, str]]]:
    compat = os.environ.get("ZSTACK_COMPAT")
    zstack_env = {"PYTHONPATH": compat} if compat else {}
    return {
        "zstack": (os.environ.get("ZSTACK_PYTHON", sys.executable), zstack_env),
        "DeepSpeed": (os.environ.get("DEEPSPEED_PYTHON", sys.executable), {}),
    }


def run_once(case: str, python: str, env: dict[str, str]) -> dict[str, Any]:
    """One round of `case` on 2 ranks: how it ended on each rank, and the time to the end."""
    with tempfile.TemporaryDirectory(prefix=f"failure-{case}-") as tmp:
        work = Path(tmp)
        reason = _prepare(case, work)
        if reason:
            return {"skipped": reason}
        port = free_port()
        procs = [
            subprocess.Popen(
                [python, str(BENCH / "_failure_cases.py"), case, str(work)],
                env={**rank_env(rank, WORLD, port), **env, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(WORLD)
        ]
        start = time.time()
        outputs: list[tuple[str, str]] = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, start + LIMIT - time.time())))
            except subprocess.TimeoutExpired:
                for q in procs:  # a stopped rank must be woken to die
                    if q.poll() is None:
                        os.kill(q.pid, signal.SIGCONT)
                        q.kill()
                outputs.append(p.communicate())
        _unmount(work)
        ranks = []
        for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if lines:
                ranks.append(json.loads(lines[-1].removeprefix("RESULT ")))
            elif p.returncode in (-signal.SIGKILL, -signal.SIGSTOP) or p.returncode is None:
                ranks.append({"rank": rank, "outcome": "hang"})
            else:
                tail = (err.strip().splitlines() or ["(no output)"])[-1][:200]
                ranks.append({"rank": rank, "outcome": f"died ({p.returncode})", "error": tail})
        for r in ranks:
            if r["rank"] == STOPPED.get(case) and r["outcome"] == "hang":
                r["outcome"] = "stopped"  # by the case itself: it cannot report
        diverged = [r["diverged"] for r in ranks if r.get("diverged")]
        ended = [r["ended"] for r in ranks if r.get("ended")]
        # a hang: no rank could say anything (a rank that did is timed, the others shown)
        hung = not ended
        seconds = None if hung or not diverged else max(ended) - min(diverged)
        return {"ranks": ranks, "seconds": seconds, "hung": hung}


def describe(rounds: list[dict[str, Any]]) -> tuple[str, str]:
    """What the user sees (from the last round) and the median time to it."""
    if "skipped" in rounds[-1]:
        return f"not run: {rounds[-1]['skipped']}", "-"
    seen = []
    for r in rounds[-1]["ranks"]:
        what = r["outcome"]
        if what == "error":
            what = r["error"]
        elif what == "payload":
            what = "the payload ran" + (f", then {r['error']}" if r.get("error") else "")
        elif what == "ok":
            what = "no error"
        elif what.startswith("died"):
            what = f"{what}: {r.get('error', '')}"
        elif what == "hang":
            what = "hangs"
        elif what == "stopped":
            what = "stopped (SIGSTOP)"
        seen.append(f"rank {r['rank']}: {what}")
    times = [r["seconds"] for r in rounds if r.get("seconds") is not None]
    if any(r.get("hung") for r in rounds):
        return "; ".join(seen), f"killed at {LIMIT:.0f} s"
    return "; ".join(seen), f"{statistics.median(times):.2f} s" if times else "-"


def main() -> None:
    from _failure_cases import CASES

    chosen = sys.argv[1:] or list(CASES)
    rows = []
    for case in chosen:
        for engine, (python, env) in _interpreters().items():
            rounds = [run_once(case, python, env)]
            hangs = rounds[0].get("hung") or "skipped" in rounds[0]
            rounds += [] if hangs else [run_once(case, python, env) for _ in range(ROUNDS - 1)]
            seen, seconds = describe(rounds)
            rows.append((case, engine, seen, seconds))
            print(f"{case} | {engine} | {seen} | {seconds}", flush=True)
    print("\n| case | engine | what the user sees | time to error |\n|---|---|---|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
