"""What the entry-point tests of zengine (test_entry_points.py) and of the compatibility package
(its tests/test_entry_points.py, which loads this file by path) share: finding a package's
commands in its files, the table of real jobs, and running one command through its usage, its
job and a bad argument. Only the standard library, torch, zcomm and zengine: both test
environments hold them."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zcomm.launch import encode_world_info
from zengine._checkpoint import fp32_state_dict, read_safetensors

__all__ = [
    "LAUNCH",
    "NODE",
    "EntryPoint",
    "Job",
    "check_command",
    "entry_points",
    "run_all",
    "stale_jobs",
]


@dataclasses.dataclass(frozen=True)
class Job:
    """A command's real job: its arguments (``{ckpt}``: a checkpoint, ``{out}``: an empty
    folder, ``{script}``: `SCRIPT`'s file, ``{port}``: a free port, ``{world_info}``:
    `WORLD_INFO`), what it must make under {out} (a state dict file: the checkpoint's model)
    or print, and arguments it must refuse."""

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


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    name: str  # the console script's or the module's name
    command: tuple[str, ...]  # how to run it
    target: str = ""  # a console script's module (``deepspeed.launcher.runner``)

    def __str__(self) -> str:
        return " ".join(self.command[1:]) if self.command[0] == sys.executable else self.name


def entry_points(roots: list[Path]) -> list[EntryPoint]:
    """The console scripts the packages at `roots` declare and the modules of theirs that run
    with -m."""
    found = []
    for root in roots:
        for script, target in declared_scripts(root / "pyproject.toml").items():
            path = shutil.which(script, path=Path(sys.executable).parent)
            found.append(EntryPoint(script, (path or f"<{script} is not installed>",), target))
        for source in sorted((root / "src").rglob("*.py")):
            module = ".".join(source.relative_to(root / "src").with_suffix("").parts)
            if source.name == "__main__.py":
                module = module.removesuffix(".__main__")
            elif not runs_as_main(source):
                continue
            found.append(EntryPoint(module, (sys.executable, "-m", module)))
    return found


def declared_scripts(pyproject: Path) -> dict[str, str]:
    """The names under ``[project.scripts]`` and the modules they run (tomllib is Python
    3.11's; we support 3.10)."""
    text = pyproject.read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    lines = section.group(1).splitlines() if section else []
    line = re.compile(r"^([\w.-]+)\s*=\s*\"([\w.]+):")
    return {m.group(1): m.group(2) for m in map(line.match, lines) if m}


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


def stale_jobs(entries: list[EntryPoint], *tables: Mapping[str, object]) -> list[str]:
    """The table entries whose command is no longer found."""
    found = {e.name for e in entries}
    return [k for table in tables for k in table if k.split()[0] not in found]


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
    """`done` ran `job`: it exited 0, printed what it must, and made its file, which holds the
    model of `checkpoint` if it is a state dict file written into {out} itself."""
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


def module_twin(entry: EntryPoint, entries: list[EntryPoint]) -> EntryPoint | None:
    """The ``python -m`` form of the console script `entry`, where both run one program (the
    script ``zengine`` and ``python -m zengine``, ``deepspeed`` and ``python -m
    deepspeed.launcher.runner``); None for a module or a script without one."""
    if entry.command[0] == sys.executable:
        return None
    names = {entry.name, entry.target}
    twins = [e for e in entries if e.name in names and e.command[0] == sys.executable]
    return twins[0] if twins else None


def check_command(
    entry: EntryPoint,
    jobs: dict[str, Job],
    internal: dict[str, str],
    checkpoint: Path,
    tmp_path: Path,
    twin: EntryPoint | None = None,
) -> None:
    """`entry` (and each of its subcommands) prints its usage, does its job from `jobs` on
    `checkpoint` (whose model a state dict it writes must equal) and refuses its bad
    arguments; a command named in `internal` must fail on its own. A console script with a
    `twin` (its ``python -m`` form, which does all of that) is checked for its wiring: its
    usage offers the twin's subcommands."""
    assert Path(entry.command[0]).exists(), f"{entry}: declared, but not installed"
    if twin is not None:
        script, module = run_all([[*entry.command, "--help"], [*twin.command, "--help"]])
        assert script.returncode == 0, script.stderr
        assert "usage:" in script.stdout, script.stdout
        assert subcommands(script.stdout) == subcommands(module.stdout), script.stdout
        return
    if entry.name in internal:
        [alone] = run_all([[*entry.command, "--help"]])
        assert alone.returncode != 0, f"{entry} ({internal[entry.name]}) exited 0 on --help"
        return
    [top] = run_all([[*entry.command, "--help"]])
    assert top.returncode == 0, top.stderr
    assert "usage:" in top.stdout, top.stdout
    subs = subcommands(top.stdout)
    names = [f"{entry.name} {s}" for s in subs] or [entry.name]
    missing = [n for n in names if n not in jobs]
    assert not missing, f"{entry}: no real job in JOBS for {missing}"
    (tmp_path / "job.py").write_text(SCRIPT)
    places = {"script": str(tmp_path / "job.py"), "world_info": WORLD_INFO}
    commands: list[list[str]] = []
    outs: list[Path] = []
    for sub, name in zip(subs or [""], names, strict=True):
        job, out = jobs[name], tmp_path / f"out-{sub}"
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
        check_output(jobs[name], checkpoint, out, ran)
        assert refused.returncode != 0, f"{refused.args} exited 0: {refused.stdout}"
    if subs:
        assert results[-1].returncode != 0, results[-1].stdout
