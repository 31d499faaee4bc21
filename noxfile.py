"""Every task a person or CI runs: tests, interop, torch_versions, tests-gpu, lint, typecheck,
bench, demo.

Each package is installed from its own metadata into a fresh virtual environment that holds only
that package and what it declares, so an undeclared import fails here as it would for a user.
Torch is installed first from a pin (constraints.txt, or $ZSTACK_TORCH on GPU machines): an
unpinned `torch` would download the newest CUDA build, gigabytes. It is installed once, into a
folder under .nox/ that every session's venv reads through a .pth file (`_torch`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).parent
PACKAGES = ["zpipe", "zcomm", "zpartition", "zoffload", "zengine"]
# The DeepSpeed compatibility package (the distribution `deepspeed`), above all five: its tests
# drive Transformers, Accelerate, PEFT and TRL, the newest releases from PyPI, so CI meets a release
# that needs a DeepSpeed name zstack lacks.
COMPAT = "deepspeed-compat"
HF_LIBRARIES = ["transformers", "accelerate", "peft", "trl", "safetensors"]
# zengine's tests that read and write DeepSpeed's own checkpoint formats with the real DeepSpeed
# (marked `deepspeed`, `nox -s interop`): its release whose formats zstack follows, from PyPI.
DEEPSPEED = "deepspeed==0.19.8"
CONSTRAINTS = str(ROOT / "constraints.txt")
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100"]
BUILD_BACKEND = "hatchling>=1.21"  # every package's [build-system] requires

nox.options.sessions = ["lint", "typecheck", "docs", "tests", "interop"]
nox.options.default_venv_backend = "virtualenv"


def _requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9_.\-]+", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


def _declared(package: str) -> list[str]:
    """The dependency names in a package's pyproject (not its extras)."""
    pyproject = nox.project.load_toml(ROOT / "packages" / package / "pyproject.toml")
    return [_requirement_name(r) for r in pyproject["project"]["dependencies"]]


def _closure(package: str) -> list[str]:
    """The package and every sibling it needs, transitively, dependencies first."""
    order: list[str] = []

    def visit(name: str) -> None:
        for dependency in _declared(name):
            if dependency in PACKAGES and dependency not in order:
                visit(dependency)
        if name not in order:
            order.append(name)

    visit(package)
    return order


def _pip_install(session: nox.Session, *args: str) -> None:
    """`session.install` without byte-compiling: pip compiles every module of torch, half of
    its install time in each session's venv, where Python compiles on import only the modules
    a session uses. Those are written once for the session's later processes to read, even
    where the machine sets PYTHONDONTWRITEBYTECODE (every worker would compile torch again)."""
    session.install("--no-compile", *args)
    session.env["PYTHONDONTWRITEBYTECODE"] = ""  # empty: Python writes bytecode


def _needs_torch(packages: list[str]) -> bool:
    return any("torch" in _declared(p) for p in packages)


def _torch(session: nox.Session, spec: list[str] | None = None) -> None:
    """Torch from the pin, for this session's venv. Installing it is about 25 s, seven times in
    CI's run of about 15 minutes, so pip installs it (with what it needs) once into a folder
    under .nox/, keyed by the pin and the Python version, and each venv reads that folder
    through a .pth file; pip then finds torch installed. Only torch and its own requirements
    are shared: each package and its dependencies still go into the session's venv alone. The
    folder's modules are compiled once, on first import (`_pip_install` lets Python write
    bytecode), for every later session. `spec` (pip arguments naming one release, as
    `torch_versions` gives) replaces the pin; the folder's key names it, so each release has
    its own."""
    spec = spec or shlex.split(os.environ.get("ZSTACK_TORCH", "")) or ["-c", CONSTRAINTS, "torch"]
    where = "import sys, sysconfig; print(sysconfig.get_paths()['purelib']); print(sys.version)"
    output = session.run("python", "-c", where, silent=True)
    assert isinstance(output, str)
    purelib, version = output.strip().splitlines()[:2]
    key = hashlib.sha256("\n".join([*spec, version]).encode()).hexdigest()[:12]
    shared = ROOT / ".nox" / f"_torch-{key}"
    if not (shared / "INSTALLED").exists():  # a folder an interrupted run left goes first
        shutil.rmtree(shared, ignore_errors=True)
        _pip_install(session, "--target", str(shared), *spec)
        (shared / "INSTALLED").touch()
    Path(purelib, "zstack_torch.pth").write_text(f"{shared}\n")


def _install(
    session: nox.Session, packages: list[str], *extra: str, torch: str | None = None
) -> None:
    """Torch from the pin first (if any package needs it), then the packages from their paths.
    `torch` (a version) replaces the pin, in the shared folder and in the constraints."""
    constraints = CONSTRAINTS
    if torch is not None:
        # constraints.txt but its torch line, which would take the pinned release back
        lines = [
            line
            for line in Path(CONSTRAINTS).read_text().splitlines()
            if not re.match(r"\s*torch\b(?![-_.\w])", line)
        ]
        constraints = str(Path(session.create_tmp()) / "constraints.txt")
        Path(constraints).write_text("\n".join([*lines, f"torch=={torch}", ""]))
    if _needs_torch(packages):
        _torch(session, None if torch is None else [f"torch=={torch}"])
    paths = [str(ROOT / "packages" / p) for p in packages]
    # hatchling, installed once, builds every package: an isolated build would install it into
    # a fresh environment for each one (about 2 s a package, some 15 builds in CI's run)
    _pip_install(session, BUILD_BACKEND)
    _pip_install(session, "--no-build-isolation", "-c", constraints, *paths, *extra)


@nox.session
@nox.parametrize("package", [*PACKAGES, COMPAT], ids=[*PACKAGES, COMPAT])
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, in a venv holding only it and what it declares (and, for the
    compatibility package, the Hugging Face libraries its tests drive)."""
    extra = HF_LIBRARIES if package == COMPAT else []
    _install(session, _closure(package), *TEST_DEPS, *extra)
    session.run(
        "pytest",
        str(ROOT / "packages" / package / "tests"),
        "-m",
        "not gpu and not deepspeed",
        *session.posargs,
    )


def _torch_floor(package: str) -> str:
    """The lowest torch a package and the siblings it needs allow: the highest of their
    `torch>=X` (a torch requirement without a lower bound is an error here)."""
    floors = []
    for name in _closure(package):
        pyproject = nox.project.load_toml(ROOT / "packages" / name / "pyproject.toml")
        for line in pyproject["project"]["dependencies"]:
            requirement = Requirement(line)
            if requirement.name != "torch":
                continue
            lower = [s.version for s in requirement.specifier if s.operator in (">=", "==")]
            if not lower:
                raise ValueError(f"{name}: {line!r} names no lowest torch (torch>=X)")
            floors.append(lower[0])
    return str(max(Version(v) for v in floors))


_NEWEST: list[str] = []  # the newest torch, once found in this nox run


def _torch_newest(session: nox.Session) -> str:
    """The newest torch release on the index, asked once per nox run."""
    if not _NEWEST:
        output = session.run("python", "-m", "pip", "index", "versions", "torch", silent=True)
        match = re.search(r"^torch \(([^)]+)\)", str(output), re.MULTILINE)
        if match is None:
            session.error(f"pip index versions torch: no version in {output!r}")
        _NEWEST.append(match.group(1))
    return _NEWEST[0]


# The packages that need torch: zpipe's tests run without it, the same on every release.
TORCH_PACKAGES = [p for p in [*PACKAGES, COMPAT] if _needs_torch(_closure(p))]
# What CI runs of them (`nox -t torch-ci`), within its 90 minutes beside `tests` (about 20) and
# the rest: each distinct floor once (zoffload 2.4, zcomm 2.8, which zpartition shares, zengine
# 2.9, which the compatibility package shares), and the newest release under zengine, whose
# tests drive zcomm, zpartition and zoffload through the engine, DCP and checkpoints, where torch
# releases change what we use. The rest (`nox -t torch-floor`, `-t torch-newest`) runs by hand.
TORCH_CI = {
    "floor": ["zoffload", "zcomm", "zengine"],
    "newest": ["zengine"],
}


def _torch_tags(which: str, package: str) -> list[str]:
    return [f"torch-{which}"] + (["torch-ci"] if package in TORCH_CI[which] else [])


@nox.session
@nox.parametrize(
    ("which", "package"),
    [
        nox.param(which, p, id=f"{which}-{p}", tags=_torch_tags(which, p))
        for which in ("floor", "newest")
        for p in TORCH_PACKAGES
    ],
)
def torch_versions(session: nox.Session, which: str, package: str) -> None:
    """One package's tests on the lowest torch its pyproject allows (`floor`: the highest
    `torch>=` of it and the siblings it needs) or on the newest torch release (`newest`, asked
    of the index when the session runs), as `tests` runs them on the pin. PyPI's Linux torch is
    a CUDA build (about 3 GB with its nvidia packages, each release once under .nox/: four
    today, 2.4 for zoffload, 2.8 for zcomm and zpartition, 2.9 for zengine and the
    compatibility package, and the newest); it runs on the CPU. All of it takes about an hour
    on 2 cores (`-t torch-floor` or `-t torch-newest` half of it); CI runs `-t torch-ci`
    after `interop` (`TORCH_CI`)."""
    if which == "newest":
        # The machine's pip configuration may cap torch (a constraint file in /etc/xdg/pip):
        # PIP_CONSTRAINT= cannot lift a config file's constraint, no configuration file can
        session.env["PIP_CONFIG_FILE"] = os.devnull
        torch = _torch_newest(session)
    else:
        torch = _torch_floor(package)
    session.log(f"{package} on torch {torch} ({which})")
    extra = HF_LIBRARIES if package == COMPAT else []
    _install(session, _closure(package), *TEST_DEPS, *extra, torch=torch)
    # the release asked for, as X.Y.Z (the floor may read 2.8), is the one the tests import
    release = ".".join(str(part) for part in (*Version(torch).release, 0, 0)[:3])
    check = f"import torch; v = torch.__version__; assert v.split('+')[0] == {release!r}, v"
    session.run("python", "-c", check)
    session.run(
        "pytest",
        str(ROOT / "packages" / package / "tests"),
        "-m",
        "not gpu and not deepspeed",
        *session.posargs,
    )


@nox.session
def interop(session: nox.Session) -> None:
    """zengine's tests marked `deepspeed`, beside the real DeepSpeed (its checkpoint formats,
    both ways). A session of its own: DeepSpeed compiles two CPU ops on its first start, minutes
    on 2 cores, and the compatibility package, also called `deepspeed`, stays out of this venv.
    CI runs it after `tests`."""
    _install(session, _closure("zengine"), *TEST_DEPS)
    # DeepSpeed builds against the torch already installed (its setup.py imports torch)
    _pip_install(session, "setuptools", "wheel")
    _pip_install(session, "--no-build-isolation", "-c", CONSTRAINTS, DEEPSPEED)
    tests_dir = ROOT / "packages" / "zengine" / "tests"
    session.run("pytest", str(tests_dir), "-m", "deepspeed and not gpu", *session.posargs)


@nox.session(name="tests-gpu")
def tests_gpu(session: nox.Session) -> None:
    """The tests marked `gpu`, all packages in one env; fails loudly without a CUDA device."""
    _install(session, PACKAGES, *TEST_DEPS)
    session.run(
        "python",
        "-c",
        "import sys, torch; sys.exit(0 if torch.cuda.is_available() else "
        "'tests-gpu: no CUDA device is visible (torch.cuda.is_available() is False)')",
    )
    test_dirs = [str(ROOT / "packages" / p / "tests") for p in PACKAGES]
    session.run("pytest", *test_dirs, "-m", "gpu", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, and the import-boundary contracts of ARCHITECTURE.md and of zengine's layers and
    subpackages (import-linter; 2.17 brought the private_modules contract)."""
    _pip_install(session, "ruff>=0.6", "import-linter>=2.17")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))
    src_dirs = os.pathsep.join(str(ROOT / "packages" / p / "src") for p in [*PACKAGES, COMPAT])
    # --no-cache: a cache left by an earlier run once reported imports the code no longer has
    lint_imports = ["lint-imports", str(ROOT / "pyproject.toml"), "--no-cache"]
    session.run(*lint_imports, env={"PYTHONPATH": src_dirs})


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on every package, its tests, the benchmarks and the examples."""
    _torch(session)
    _pip_install(
        session,
        "-c",
        CONSTRAINTS,
        "mypy>=1.10",
        "nox",
        "pydantic>=2.6",
        "hjson",
        *TEST_DEPS,
    )
    config = ["--config-file", str(ROOT / "pyproject.toml")]
    for package in [*PACKAGES, COMPAT]:
        package_dir = ROOT / "packages" / package
        session.run("mypy", *config, str(package_dir / "src"), str(package_dir / "tests"))
    session.run(
        "mypy",
        *config,
        str(ROOT / "bench"),
        str(ROOT / "examples"),
        str(ROOT / "docs"),
        str(ROOT / "noxfile.py"),
    )


@nox.session
def docs(session: nox.Session) -> None:
    """The API reference (mkdocs.yml, docs/): one page per package from the docstrings, into
    .docs-site/. Fails on a broken reference (--strict) and on a public name (an `__all__`'s)
    missing from it (docs/test_reference.py)."""
    _install(session, [*PACKAGES, COMPAT], "mkdocs>=1.6", "mkdocstrings-python>=1.10", "pytest>=8")
    session.run("mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"))
    session.run("pytest", str(ROOT / "docs" / "test_reference.py"), "-q")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmarks in bench/, side by side with the peers. `nox -s bench -- zpipe` runs one.

    DeepSpeed is a peer of zengine's benchmark; its first run compiles two CPU ops (g++)."""
    # isal: zoffload's crc extra, the CRC its NVMe writes need to keep up with dd on 2 cores
    bench_deps = ["deepspeed>=0.19,<0.20", "transformers", "accelerate", "peft", "isal>=1.6"]
    _install(session, PACKAGES, *bench_deps)
    # The loading and Trainer benchmarks drive Transformers (and PEFT) on zstack: the compatibility
    # `deepspeed`, put first on the path for them alone (the others keep the real DeepSpeed).
    compat = Path(session.create_tmp()) / "deepspeed-compat"
    _pip_install(
        session,
        "--no-deps",
        "--upgrade",
        "--target",
        str(compat),
        str(ROOT / "packages/deepspeed-compat"),
    )
    chosen = session.posargs or [
        p.stem.removeprefix("bench_") for p in sorted(ROOT.glob("bench/bench_*.py"))
    ]
    for name in chosen:
        env = {"PYTHONPATH": str(compat)} if name in ("load", "trainer") else {}
        if name in ("deepspeed_tests", "failures"):  # twice each: with compat first, and not
            env = {"ZSTACK_COMPAT": str(compat)}
        session.run("python", str(ROOT / "bench" / f"bench_{name}.py"), env=env)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a small GPT trained with ZeRO-3 on 2 processes (gloo on CPU, NCCL on GPU;
    as many as there are GPUs, up to 2)."""
    # NumPy only quiets torch's "Failed to initialize NumPy" warning at every rank's start
    _install(session, _closure("zengine"), "numpy")
    # NCCL takes a GPU per rank: on a machine with one GPU the demo trains on one rank
    gpus = session.run(
        "python", "-c", "import torch; print(torch.cuda.device_count())", silent=True
    )
    ranks = min(2, int(str(gpus).split()[-1])) or 2
    session.run(
        "python",  # torchrun's module: its script lies in the shared torch folder (`_torch`)
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        str(ROOT / "examples" / "train_gpt.py"),
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )
