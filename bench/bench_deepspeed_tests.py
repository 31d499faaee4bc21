"""DeepSpeed's own ZeRO, offload and pipeline unit tests, unmodified, on zstack (through the
compatibility `deepspeed`) against DeepSpeed itself, on this machine: passed, failed and skipped
cases per file.

Run by ``nox -s bench -- deepspeed_tests`` with ``DEEPSPEED_TESTS`` naming a copy of DeepSpeed's
``tests`` folder (the ``fetch`` tool brings DeepSpeed's repository; copy its ``tests`` folder out
of the checkout, so that DeepSpeed's own sources are not what ``import deepspeed`` finds). Nothing
of DeepSpeed is in this repository. Outside nox: ``DEEPSPEED_TESTS=... ZSTACK_PYTHON=...
DEEPSPEED_PYTHON=... python bench/bench_deepspeed_tests.py [FILE ...]``, each interpreter one
whose ``import deepspeed`` is the package to test; ``ZSTACK_COMPAT`` (a folder put first on
``PYTHONPATH`` for zstack's runs) lets one interpreter with DeepSpeed installed serve both.

Every file runs in a fresh ``pytest`` for each contender, with DeepSpeed's own harness (it
spawns the ranks), ``LOCAL_SIZE=4`` (DeepSpeed's CPU accelerator counts that many devices, so
its tests of 2 and 4 ranks run instead of skipping for want of GPUs) and
``DS_UNITTEST_TIMEOUT`` seconds per test; a file still running after ``FILE_TIMEOUT`` seconds is
stopped, and its cases not reported count as hung. ``DEEPSPEED_TESTS_REPORTS``, if set, names a
folder where each run's JUnit report is kept (``<contender>/<file>.xml``), to read which cases
failed and why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

# DeepSpeed's tests of what zstack covers: ZeRO, offload and pipelines
FOLDERS = ["unit/v1/zero", "unit/runtime/zero", "unit/pipe", "unit/runtime/pipe"]
FILE_TIMEOUT = 1800  # seconds a file may run
TEST_TIMEOUT = 300  # seconds a test may run in DeepSpeed's harness (JIT builds included)


@dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    hung: bool = False

    def __str__(self) -> str:
        hung = " (stopped: hung)" if self.hung else ""
        return f"{self.passed} / {self.failed} / {self.skipped}{hung}"


def _run(name: str, python: str, compat: str | None, tests: Path, test_file: str) -> Counts:
    """One file's cases with one contender."""
    env = {**os.environ, "LOCAL_SIZE": "4", "DS_UNITTEST_TIMEOUT": str(TEST_TIMEOUT)}
    env.pop("PYTHONPATH", None)
    if compat:
        env["PYTHONPATH"] = compat
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        command = [python, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
        command += [f"--junitxml={report}"]
        counts = Counts()
        try:
            subprocess.run(
                command, cwd=tests, env=env, capture_output=True, timeout=FILE_TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired:
            counts.hung = True
        if not report.exists():  # stopped before pytest wrote it, or it never started
            counts.hung = True
            return counts
        _keep(report, name, test_file)
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            if case.find("skipped") is not None:
                counts.skipped += 1
            elif case.find("failure") is not None or case.find("error") is not None:
                counts.failed += 1
            else:
                counts.passed += 1
        return counts


def _keep(report: Path, contender: str, test_file: str) -> None:
    """A copy of `report` under ``DEEPSPEED_TESTS_REPORTS``, if that is set."""
    folder = os.environ.get("DEEPSPEED_TESTS_REPORTS")
    if folder:
        kept = Path(folder) / contender / (test_file.replace("/", "_") + ".xml")
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(report, kept)


def main() -> None:
    root = os.environ.get("DEEPSPEED_TESTS")
    if not root:
        print("bench_deepspeed_tests: skipped, DEEPSPEED_TESTS names no DeepSpeed tests folder")
        return
    tests = Path(root)
    files = sys.argv[1:] or [
        str(f.relative_to(tests)) for d in FOLDERS for f in sorted((tests / d).glob("test_*.py"))
    ]
    python = sys.executable
    contenders = {
        "zstack": (os.environ.get("ZSTACK_PYTHON", python), os.environ.get("ZSTACK_COMPAT")),
        "DeepSpeed": (os.environ.get("DEEPSPEED_PYTHON", python), None),
    }
    print(
        f"\n### DeepSpeed's unit tests, unmodified, on CPU ({len(files)} files): "
        "passed / failed / skipped cases per contender\n"
    )
    print("| file | zstack | DeepSpeed |")
    print("|---|---|---|")
    totals = {name: Counts() for name in contenders}
    for test_file in files:
        row = []
        for name, (python, compat) in contenders.items():
            counts = _run(name, python, compat, tests, test_file)
            totals[name].passed += counts.passed
            totals[name].failed += counts.failed
            totals[name].skipped += counts.skipped
            row.append(str(counts))
        print(f"| {test_file} | {row[0]} | {row[1]} |", flush=True)
    print(f"| all | {totals['zstack']} | {totals['DeepSpeed']} |")


if __name__ == "__main__":
    main()
