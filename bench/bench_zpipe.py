"""zpipe: generating and validating whole schedules, against torch.distributed.pipelining.

Each measurement runs in a fresh process (cold caches, imports excluded), zpipe and torch
interleaved, and the table shows medians of CPU and wall time. zpipe's figure is
`validate()`, which builds every stage's schedule and then runs all of them together; torch's is
`get_schedule_ops(..., with_comms=True)`, which builds the schedule and lowers it with its
communication for every rank (what each torch rank does at start-up), without validation. Its
lowering takes only multi-stage-per-rank schedules, so for 1F1B and GPipe torch's figure is the
compute-only order (`with_comms=False`), less work than zpipe does.

    nox -s bench -- zpipe
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STAGES, MICRO_BATCHES, REPEATS = 32, 256, 5

ZPIPE_CASE = """
import json, time, zpipe
cls = zpipe.schedule_class({name!r})
wall, cpu = time.perf_counter(), time.process_time()
report = zpipe.validate(cls, {m}, {p}, **{kwargs!r})
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
print(json.dumps({{"wall": wall, "cpu": cpu, "instructions": sum(report.instructions)}}))
"""

TORCH_CASE = """
import json, time
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
wall, cpu = time.perf_counter(), time.process_time()
ops = get_schedule_ops({name!r}, {p}, {m}, num_stages_per_rank={v}, with_comms={v} is not None)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
count = sum(1 for rank in ops for op in rank if op is not None)
print(json.dumps({{"wall": wall, "cpu": cpu, "instructions": count}}))
"""

# (label, zpipe schedule, its kwargs, torch schedule or None, torch stages per rank)
CASES = [
    ("interleaved 1F1B, 2 chunks", "interleaved", {"chunks": 2}, "Interleaved1F1B", 2),
    ("1F1B (torch: compute only)", "1f1b", {}, "1F1B", None),
    ("GPipe (torch: compute only)", "gpipe", {}, "GPipe", None),
    ("ZB-H1", "zb-h1", {}, None, None),
]


def _run(code: str) -> dict[str, float] | str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return done.stderr.strip().splitlines()[-1][:80]
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _median(runs: list[dict[str, float] | str], key: str) -> str:
    values = [r[key] for r in runs if isinstance(r, dict)]
    failure = next((r for r in runs if isinstance(r, str)), None)
    return f"{statistics.median(values):.3f}" if values else f"fails: {failure}"


def _measure_schedules() -> None:
    print(f"### Generate and validate all {STAGES} stages, {MICRO_BATCHES} micro-batches")
    print(f"median of {REPEATS} fresh processes each, zpipe and torch interleaved\n")
    print("| schedule | zpipe CPU s | zpipe wall s | instructions | torch CPU s | torch wall s |")
    print("|---|---|---|---|---|---|")
    for label, name, kwargs, torch_name, per_rank in CASES:
        ours, theirs = [], []
        for _ in range(REPEATS):
            ours.append(
                _run(ZPIPE_CASE.format(name=name, m=MICRO_BATCHES, p=STAGES, kwargs=kwargs))
            )
            if torch_name is not None:
                code = TORCH_CASE.format(name=torch_name, p=STAGES, m=MICRO_BATCHES, v=per_rank)
                theirs.append(_run(code))
        count = next((int(r["instructions"]) for r in ours if isinstance(r, dict)), 0)
        torch_cols = (
            f"{_median(theirs, 'cpu')} | {_median(theirs, 'wall')}" if theirs else "n/a | n/a"
        )
        ours_cols = f"{_median(ours, 'cpu')} | {_median(ours, 'wall')}"
        print(f"| {label} | {ours_cols} | {count} | {torch_cols} |")


def _closed_forms() -> None:
    """Simulated bubbles against the closed forms, p = 8 stages, m = 32 micro-batches."""
    import zpipe

    p, m = 8, 32
    rows: list[tuple[str, type[zpipe.PipeSchedule], dict[str, int], float]] = [
        ("1F1B, F=1 B=2", zpipe.TrainSchedule, {}, (p - 1) / (m + p - 1)),
        ("GPipe, F=1 B=2", zpipe.GPipeSchedule, {}, (p - 1) / (m + p - 1)),
        (
            "interleaved v=2",
            zpipe.Interleaved1F1BSchedule,
            {"chunks": 2},
            (p - 1) / (2 * m + p - 1),
        ),
        (
            "interleaved v=4",
            zpipe.Interleaved1F1BSchedule,
            {"chunks": 4},
            (p - 1) / (4 * m + p - 1),
        ),
        (
            "ZB-H1, F=B=W=1",
            zpipe.ZeroBubbleH1Schedule,
            {"backward": 1, "weight": 1},
            (p - 1) / (3 * m + p - 1),
        ),
    ]
    print(f"\n### Simulated bubble against the closed form, {p} stages, {m} micro-batches\n")
    print("| schedule | simulated bubble | closed form | peak activations, stage 0 .. 7 |")
    print("|---|---|---|---|")
    for label, cls, kwargs, closed in rows:
        result = zpipe.simulate(cls, m, p, **kwargs)
        peaks = " ".join(f"{x:g}" for x in result.peak_activations)
        print(f"| {label} | {result.bubble_fraction:.4%} | {closed:.4%} | {peaks} |")


def _installed_by_pip() -> None:
    """What `pip install packages/zpipe` would install into an empty environment."""
    package = Path(__file__).resolve().parent.parent / "packages" / "zpipe"
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run"]
        command += ["--ignore-installed", "--report", str(report_path), str(package)]
        subprocess.run(command, check=True)
        report = json.loads(report_path.read_text())
    names = sorted(item["metadata"]["name"] for item in report["install"])
    print(f"\n`pip install packages/zpipe` installs: {', '.join(names)}")


def main() -> None:
    _measure_schedules()
    _closed_forms()
    _installed_by_pip()


if __name__ == "__main__":
    main()
