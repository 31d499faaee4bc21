"""Every command of the compatibility package does its job: each console script it declares
(``[project.scripts]``) and each of its modules ``python -m`` runs (a ``__main__.py``, or a
module with ``if __name__ == "__main__"``), found in its files, not listed by hand. Each prints
its usage with ``--help`` and exits 0; does a real job (on a checkpoint zstack saved here, one
rank), whose output is checked; and refuses a bad argument with a non-zero exit. A command
found with no job in `JOBS` fails the test by name, so a new command cannot go untested.
zengine's and the other packages' commands: packages/zengine/tests/test_entry_points.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

PACKAGE = Path(__file__).resolve().parents[1]  # packages/deepspeed-compat
TAG = "t"


def _shared() -> Any:
    """zengine's tests' module of what both entry-point tests share, loaded by its path (the
    checkout's: this environment holds zengine, not its tests)."""
    path = PACKAGE.parent / "zengine" / "tests" / "_entry_points.py"
    spec = importlib.util.spec_from_file_location("zstack_entry_points", path)
    assert spec is not None, path
    assert spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


shared: Any = _shared()
Job, LAUNCH, NODE, run_all = shared.Job, shared.LAUNCH, shared.NODE, shared.run_all

# a command (a console script or a module; "name subcommand" for each subcommand) -> its job
JOBS = {
    "deepspeed": Job(LAUNCH, "--num_gpus 0 {script}", "rank1"),
    "deepspeed.launcher.runner": Job(LAUNCH, "--num_gpus 0 {script}", "rank1"),
    "deepspeed.launcher.launch": Job(NODE, "--world_info !!! {script} {out}", "rank0"),
    "ds_report": Job("", "--no-such-flag", prints="zstack"),
    "deepspeed.env_report": Job("", "--no-such-flag", prints="zstack"),
    "deepspeed.utils.zero_to_fp32": Job(
        "{ckpt} {out} --safe_serialization", "{out}/none {out}", "model.safetensors"
    ),
    "deepspeed.checkpoint.ds_to_universal": Job(
        "--input_folder {ckpt}/t --output_folder {out}/u",
        "--input_folder {out}/none --output_folder {out}/u",
        "u/zero/optimizer_state.pt",
    ),
}
# modules runnable with -m that are no user's command: each must fail without its caller
INTERNAL: dict[str, str] = {}

_SAVE = """
import sys, torch, deepspeed
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
engine.backward(engine(torch.randn(2, 6)).square().mean())
engine.step()
engine.save_checkpoint(sys.argv[1], tag=sys.argv[2])
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_dir with a ZeRO-3 checkpoint that zstack saved (one rank, its own process)."""
    save_dir = tmp_path_factory.mktemp("checkpoint")
    [done] = run_all([[sys.executable, "-c", _SAVE, str(save_dir), TAG]])
    assert done.returncode == 0, done.stderr
    return save_dir


ENTRY_POINTS = shared.entry_points([PACKAGE])


def test_the_known_commands_are_found() -> None:
    """The search finds what is there (a search that finds nothing would pass everything)."""
    names = {str(e) for e in ENTRY_POINTS}
    assert {"-m deepspeed.utils.zero_to_fp32", "-m deepspeed.checkpoint.ds_to_universal"} <= names
    stale = shared.stale_jobs(ENTRY_POINTS, JOBS, INTERNAL)
    assert not stale, f"jobs for commands that are gone: {stale}"


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=str)
def test_the_command_does_its_job(entry: Any, checkpoint: Path, tmp_path: Path) -> None:
    twin = shared.module_twin(entry, ENTRY_POINTS)
    shared.check_command(entry, JOBS, INTERNAL, checkpoint, tmp_path, twin)
