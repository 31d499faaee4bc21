"""Every command of the compatibility package does its job: each console script it declares
(``[project.scripts]``) and each of its modules ``python -m`` runs (a ``__main__.py``, or a
module with ``if __name__ == "__main__"``), found in its files, not listed by hand. Each prints
its usage with ``--help`` and exits 0; does a real job (on a checkpoint zstack saved here, one
rank), whose output is checked; and refuses a bad argument with a non-zero exit. A command
found with no job in `JOBS` fails the test by name, so a new command cannot go untested.
zengine's and the other packages' commands: packages/zengine/tests/test_entry_points.py.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from zcomm.launch import encode_world_info
from zengine._checkpoint import fp32_state_dict, read_safetensors

PACKAGE = Path(__file__).resolve().parents[1]  # packages/deepspeed-compat
TAG = "t"


@dataclasses.dataclass(frozen=True)
class Job:
    """A command's real job: its arguments (``{ckpt}``: zstack's save_dir, holding tag ``t``;
    ``{out}``: an empty folder; ``{script}``: `SCRIPT`'s file, ``{port}``: a free port,
    ``{world_info}``: `WORLD_INFO`), what it must make under {out} (a state dict file: the
    checkpoint's model) or print, and arguments it must refuse."""

    args: str
    bad: str
    makes: str = ""
    prints: str = ""


# the launchers' jobs: two ranks (one, a node's agent) of `SCRIPT`, each writing {out}/rank<RANK>
LAUNCH = "--num_gpus 2 --master_port {port} {script} {out}"
NODE = "--world_info {world_info} --master_port {port} {script} {out}"
WORLD_INFO = encode_world_info({"localhost": [0]})  # one node, one slot
SCRIPT = """
import os, sys
out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]
with open(os.path.join(out, "rank" + os.environ["RANK"]), "w") as f:
    f.write(os.environ["WORLD_SIZE"])
"""

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


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    name: str  # the console script's or the module's name
    command: tuple[str, ...]  # how to run it

    def __str__(self) -> str:
        return " ".join(self.command[1:]) if self.command[0] == sys.executable else self.name


def entry_points(package: Path) -> list[EntryPoint]:
    """The console scripts the package declares and the modules of its that run with -m."""
    found = []
    for script in declared_scripts(package / "pyproject.toml"):
        path = shutil.which(script, path=Path(sys.executable).parent)
        found.append(EntryPoint(script, (path or f"<{script} is not installed>",)))
    for source in sorted((package / "src").rglob("*.py")):
        module = ".".join(source.relative_to(package / "src").with_suffix("").parts)
        if source.name == "__main__.py":
            module = module.removesuffix(".__main__")
        elif not runs_as_main(source):
            continue
        found.append(EntryPoint(module, (sys.executable, "-m", module)))
    return found


def declared_scripts(pyproject: Path) -> list[str]:
    """The names under ``[project.scripts]`` (tomllib is Python 3.11's; we support 3.10)."""
    text = pyproject.read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    lines = section.group(1).splitlines() if section else []
    return [m.group(1) for m in map(re.compile(r"^([\w.-]+)\s*=").match, lines) if m]


def runs_as_main(source: Path) -> bool:
    """Whether a module has ``if __name__ == "__main__":`` at its top level."""
    for node in ast.parse(source.read_text()).body:
        test = node.test if isinstance(node, ast.If) else None
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and [ast.dump(c) for c in test.comparators] == [ast.dump(ast.Constant("__main__"))]
        ):
            return True
    return False


def run_all(commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """The commands, a few at a time (each mostly waits for torch's import)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}

    def one(command: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command, capture_output=True, text=True, env=env, check=False, timeout=300
        )

    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(one, commands))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def subcommands(help_text: str) -> list[str]:
    """The subcommands argparse lists under "positional arguments" as ``{a,b}``."""
    match = re.search(r"^positional arguments:\n\s+\{([^}]*)\}", help_text, re.M)
    return match.group(1).split(",") if match else []


def check_output(
    job: Job, checkpoint: Path, out: Path, done: subprocess.CompletedProcess[str]
) -> None:
    said = f"{done.args}: rc {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, said
    if job.prints:
        assert job.prints in done.stdout, said
    if job.makes:
        made = out / job.makes
        assert made.is_file(), said
        if made.suffix in (".pt", ".bin", ".safetensors") and made.parent == out:
            state = (
                read_safetensors(made)
                if made.suffix == ".safetensors"
                else torch.load(made, weights_only=True)
            )
            expected = fp32_state_dict(checkpoint)
            assert state.keys() == expected.keys(), said
            assert all(torch.equal(state[k], v) for k, v in expected.items()), said


ENTRY_POINTS = entry_points(PACKAGE)


def test_the_known_commands_are_found() -> None:
    """The search finds what is there (a search that finds nothing would pass everything)."""
    names = {str(e) for e in ENTRY_POINTS}
    assert {"-m deepspeed.utils.zero_to_fp32", "-m deepspeed.checkpoint.ds_to_universal"} <= names
    found = {e.name for e in ENTRY_POINTS}
    stale = [k for k in [*JOBS, *INTERNAL] if k.split()[0] not in found]
    assert not stale, f"jobs for commands that are gone: {stale}"


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=str)
def test_the_command_does_its_job(entry: EntryPoint, checkpoint: Path, tmp_path: Path) -> None:
    assert Path(entry.command[0]).exists(), f"{entry}: declared, but not installed"
    if entry.name in INTERNAL:
        [alone] = run_all([[*entry.command, "--help"]])
        assert alone.returncode != 0, f"{entry} ({INTERNAL[entry.name]}) exited 0 on --help"
        return
    [top] = run_all([[*entry.command, "--help"]])
    assert top.returncode == 0, top.stderr
    assert "usage:" in top.stdout, top.stdout
    subs = subcommands(top.stdout)
    names = [f"{entry.name} {s}" for s in subs] or [entry.name]
    missing = [n for n in names if n not in JOBS]
    assert not missing, f"{entry}: no real job in JOBS for {missing}"
    (tmp_path / "job.py").write_text(SCRIPT)
    places = {"script": str(tmp_path / "job.py"), "world_info": WORLD_INFO}
    commands: list[list[str]] = []
    outs: list[Path] = []
    for sub, name in zip(subs or [""], names, strict=True):
        job, out = JOBS[name], tmp_path / f"out-{sub}"
        out.mkdir()
        fill = {"ckpt": str(checkpoint), "out": str(out), "port": str(free_port()), **places}
        head = [*entry.command, sub] if sub else [*entry.command]
        commands.append([*head, "--help"])
        commands.append([*entry.command, *job.args.format(**fill).split()])
        commands.append([*entry.command, *job.bad.format(**fill).split()])
        outs.append(out)
    if subs:
        commands.append([*entry.command, "no-such-subcommand"])
    results = run_all(commands)
    for i, (name, out) in enumerate(zip(names, outs, strict=True)):
        usage, ran, refused = results[3 * i : 3 * i + 3]
        assert usage.returncode == 0, (name, usage.stderr)
        assert "usage:" in usage.stdout, (name, usage.stdout)
        check_output(JOBS[name], checkpoint, out, ran)
        assert refused.returncode != 0, f"{refused.args} exited 0: {refused.stdout}"
    if subs:
        assert results[-1].returncode != 0, results[-1].stdout
