"""Every command of zpipe, zcomm, zpartition, zoffload and zengine (the packages zengine's test
environment holds) does its job: each console script (``[project.scripts]``) and each module
``python -m`` runs (a ``__main__.py``, or a module with ``if __name__ == "__main__"``), found
in the packages' files, not listed by hand. Each, and each of its subcommands, prints its usage
with ``--help`` and exits 0; does a real job, whose output is checked; and refuses a bad
argument with a non-zero exit. A command found with no job in `JOBS` fails the test by name,
so a new command cannot go untested. The compatibility package's commands are tested in its
own tests (packages/deepspeed-compat/tests/test_entry_points.py), in an environment with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._ds_fixture import FIXTURES
from ._entry_points import (
    LAUNCH,
    NODE,
    EntryPoint,
    Job,
    check_command,
    entry_points,
    module_twin,
    stale_jobs,
)

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ["zpipe", "zcomm", "zpartition", "zoffload", "zengine"]
CHECKPOINT = FIXTURES / "stage3_fp32_ws2"  # DeepSpeed's own, which zstack's tools read

# a command (a console script or a module; "name subcommand" for each subcommand) -> its job
JOBS = {
    "zengine consolidate": Job("consolidate {ckpt} {out}/m.pt", "consolidate {out} x", "m.pt"),
    "zengine launch": Job("launch " + LAUNCH, "launch --num_gpus 0 {script}", "rank1"),
    "zengine report": Job("report", "report --no-such-flag", prints="zstack"),
    "zengine.utils.zero_to_fp32": Job("{ckpt} {out}", "{out}/none {out}", "pytorch_model.bin"),
    "zcomm.launch": Job(LAUNCH, "--num_gpus 0 {script}", "rank1"),
    "zcomm.launch.node": Job(NODE, "--world_info !!! {script} {out}", "rank0"),
    "zpipe": Job("1f1b --stages 2 --micro-batches 4", "no-such-schedule", prints="bubble"),
}
# modules runnable with -m that are no user's command: each must fail without its caller
INTERNAL = {
    "zcomm._worker": "zcomm's pooled test worker, started with a socket to talk over",
    "zcomm.launch._rank": "the launcher's rank shim, which torchrun's workers run",
}

ENTRY_POINTS = entry_points([REPO / "packages" / p for p in PACKAGES])


def test_the_known_commands_are_found() -> None:
    """The search finds what is there (a search that finds nothing would pass everything)."""
    names = {str(e) for e in ENTRY_POINTS}
    assert {"zengine", "-m zengine", "zpipe", "-m zpipe", "-m zengine.utils.zero_to_fp32"} <= names
    stale = stale_jobs(ENTRY_POINTS, JOBS, INTERNAL)
    assert not stale, f"jobs for commands that are gone: {stale}"


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=str)
def test_the_command_does_its_job(entry: EntryPoint, tmp_path: Path) -> None:
    twin = module_twin(entry, ENTRY_POINTS)
    check_command(entry, JOBS, INTERNAL, CHECKPOINT, tmp_path, twin)
