"""``zengine.report``: what is installed and what works on this machine, as ``zengine report``
(and, through the compatibility package, ``ds_report``) print it.

`collect` looks, `format_report` prints. Looking never starts a job: packages are found by
their metadata (zstack's five, the compatibility package and whether the ``deepspeed``
installed is it or Microsoft's DeepSpeed, torch and the Hugging Face libraries), torch is asked
what it was built with, and each feature zstack uses is checked where it can be (a file opened
with O_DIRECT in the NVMe folder, CuPy imported only where CUDA is). Each feature comes with
the reason it is or is not available.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zcomm import get_accelerator

__all__ = ["Feature", "Report", "collect", "format_report"]

ZSTACK_PACKAGES = ("zpipe", "zcomm", "zpartition", "zoffload", "zengine")
OTHER_PACKAGES = ("torch", "transformers", "accelerate", "peft", "trl", "safetensors")


@dataclass(frozen=True)
class Feature:
    """One feature: whether this machine has it, and why (or why not)."""

    name: str
    available: bool
    detail: str


@dataclass
class Report:
    """`collect`'s findings: (name, value) lines and the features."""

    packages: list[tuple[str, str]] = field(default_factory=list)
    environment: list[tuple[str, str]] = field(default_factory=list)
    features: list[Feature] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    deepspeed: str = "not installed"  # "zstack", "deepspeed" (Microsoft's) or "not installed"

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (``zengine report --json``)."""
        return asdict(self)


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _where(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "?"
    return str(Path(spec.origin).parent)


def _deepspeed_kind() -> str:
    """Which ``deepspeed`` is installed, from its metadata (zstack's says so in its summary;
    nothing here imports it: zengine does not depend on the compatibility package)."""
    try:
        summary = importlib.metadata.metadata("deepspeed")["Summary"] or ""
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    return "zstack" if "zstack" in summary else "deepspeed"


def _packages(report: Report) -> None:
    for name in ZSTACK_PACKAGES:
        version = _version(name)
        report.packages.append(
            (name, f"{version} ({_where(name)})" if version else "not installed")
        )
    version = _version("deepspeed")
    kind = _deepspeed_kind()
    report.deepspeed = kind
    if kind == "zstack":
        text = f"{version}: zstack's compatibility package ({_where('deepspeed')})"
    elif kind == "deepspeed":
        text = f"{version}: Microsoft's DeepSpeed, not zstack's compatibility package"
    else:
        text = "not installed (zstack's is packages/deepspeed-compat)"
    report.packages.append(("deepspeed", text))
    for name in OTHER_PACKAGES:
        report.packages.append((name, _version(name) or "not installed"))


def _shm() -> tuple[str, int | None]:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return "unknown", None
    size = stats.f_frsize * stats.f_blocks
    return f"{size / 2**30:.2f} GiB", size


def _environment(report: Report) -> None:
    accelerator = get_accelerator()
    try:
        cores = str(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = str(os.cpu_count())
    shm_text, shm = _shm()
    report.environment += [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("torch", f"{torch.__version__} ({_where('torch')})"),
        ("torch built with CUDA", torch.version.cuda or "no (a CPU build)"),
        ("accelerator", f"{accelerator.device_name()} ({accelerator.device_count()} device(s))"),
        ("communication backend", accelerator.communication_backend_name()),
        ("CPU cores (this process)", cores),
        ("shared memory (/dev/shm)", shm_text),
    ]
    if shm is not None and shm < 512 * 2**20:
        report.warnings.append(
            "/dev/shm is under 512 MiB: gloo and NCCL may fail; in docker raise --shm-size"
        )


def _o_direct(folder: Path) -> Feature:
    name = f"O_DIRECT under {folder}"
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return Feature(name, False, "this OS has no O_DIRECT: zoffload uses buffered I/O + fsync")
    try:
        fd, path = tempfile.mkstemp(dir=folder, prefix=".zstack-report-")
    except OSError as error:
        return Feature(name, False, f"cannot write there: {error}")
    os.close(fd)
    try:
        direct = os.open(path, os.O_WRONLY | flag)
    except OSError as error:
        return Feature(
            name,
            False,
            f"the filesystem refuses it ({error.strerror}): zoffload's NVMe files there use "
            "buffered I/O + fsync (set offload nvme_path to a local disk for O_DIRECT)",
        )
    else:
        os.close(direct)
        return Feature(name, True, "zoffload's NVMe files bypass the page cache there")
    finally:
        os.unlink(path)


def _features(report: Report, nvme_path: str | None) -> None:
    accelerator = get_accelerator()
    cuda = torch.cuda.is_available()
    add = report.features.append
    if cuda:
        count = torch.cuda.device_count()
        add(Feature("CUDA", True, f"{count} device(s): {torch.cuda.get_device_name(0)}"))
    elif torch.version.cuda is None:
        add(Feature("CUDA", False, f"torch {torch.__version__} is a CPU build"))
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        add(Feature("CUDA", False, f"no CUDA device visible (CUDA_VISIBLE_DEVICES={visible!r})"))
    nccl = dist.is_available() and dist.is_nccl_available()
    if nccl and cuda:
        version = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
        add(Feature("NCCL", True, f"NCCL {version}: the backend on CUDA"))
    else:
        why = "needs CUDA" if not cuda else "torch was built without NCCL"
        add(Feature("NCCL", False, why))
    gloo = dist.is_available() and dist.is_gloo_available()
    add(Feature("gloo", gloo, "the backend on CPU" if gloo else "torch was built without gloo"))
    mpi = dist.is_available() and dist.is_mpi_available()
    add(
        Feature(
            "MPI",
            mpi,
            "torch's MPI backend"
            if mpi
            else "torch was built without the MPI backend; scripts started by mpirun still "
            "run (zcomm reads Open MPI's and MPICH's rank variables) over gloo or NCCL",
        )
    )
    add(
        Feature(
            "pinned host memory",
            cuda,
            "page-locked buffers for offload copies (zoffload's host pool)"
            if cuda
            else "needs CUDA; on CPU, offloaded state stays in ordinary host memory",
        )
    )
    folder = Path(nvme_path) if nvme_path else Path(tempfile.gettempdir())
    add(_o_direct(folder))
    add(
        Feature(
            "NVMe offload (DeepSpeed's aio op)",
            True,
            "zoffload's own file I/O: no libaio and no compiled op needed",
        )
    )
    add(_cupy(cuda))
    isal = importlib.util.find_spec("isal") is not None
    add(
        Feature(
            "ISA-L CRC-32 for NVMe files",
            isal,
            "isal installed" if isal else "not installed (pip install zoffload[crc]); zlib's",
        )
    )
    device = accelerator.device_name()
    bf16, fp16 = accelerator.is_bf16_supported(), accelerator.is_fp16_supported()
    add(Feature("bf16", bf16, f"on {device}" if bf16 else f"{device} does not support bf16"))
    add(
        Feature(
            "fp16", fp16, f"on {device}" if fp16 else f"not on {device} (many CPU kernels lack it)"
        )
    )
    safetensors = _version("safetensors")
    add(
        Feature(
            "safetensors",
            safetensors is not None,
            f"safetensors {safetensors}: consolidated and 16-bit saves can be .safetensors"
            if safetensors
            else "not installed (pip install safetensors)",
        )
    )
    add(
        Feature(
            "C++/CUDA extension ops",
            True,
            "none needed: zstack's optimizers run on torch's kernels (no ninja, no build)",
        )
    )
    add(_hf(report.deepspeed))


def _cupy(cuda: bool) -> Feature:
    name = "CuPy copy path (zoffload)"
    if importlib.util.find_spec("cupy") is None:
        return Feature(name, False, "CuPy not installed (pip install zoffload[cuda])")
    if not cuda:
        return Feature(name, False, "CuPy is installed but needs CUDA")
    try:
        cupy = importlib.import_module("cupy")
        ok = bool(cupy.is_available())
    except Exception as error:  # a broken CuPy install says why here, not at run time
        return Feature(name, False, f"CuPy does not load: {error}")
    return Feature(name, ok, "CuPy's streams" if ok else "cupy.is_available() is False")


def _hf(kind: str) -> Feature:
    name = "Transformers/Accelerate/PEFT/TRL"
    if kind == "zstack":
        return Feature(name, True, "through the compatibility package installed as 'deepspeed'")
    if kind == "deepspeed":
        return Feature(name, False, "'deepspeed' is Microsoft's DeepSpeed, not zstack's")
    return Feature(
        name, False, "install zstack's compatibility package (packages/deepspeed-compat)"
    )


def collect(nvme_path: str | None = None) -> Report:
    """Look at this machine (``nvme_path``: where O_DIRECT is tried, default the temp dir)."""
    report = Report()
    _packages(report)
    _environment(report)
    _features(report, nvme_path)
    return report


_GREEN, _YELLOW, _END = "\033[92m", "\033[93m", "\033[0m"


def _dots(name: str, width: int) -> str:
    return f"{name} {'.' * max(2, width - len(name))}"


def format_report(
    report: Report, *, color: bool = False, warnings: bool = True, title: str = "zstack"
) -> str:
    """The report as DeepSpeed's ``ds_report`` prints its own: ``name ..... value`` lines,
    features as ``[YES]``/``[NO]`` with the reason."""
    yes = f"{_GREEN}[YES]{_END}" if color else "[YES]"
    no = f"{_YELLOW}[NO] {_END}" if color else "[NO] "
    width = 34
    rule = "-" * 78
    lines = [rule, f"{title}: installed packages", rule]
    lines += [f"{_dots(name, width)} {value}" for name, value in report.packages]
    lines += [rule, f"{title}: environment", rule]
    lines += [f"{_dots(name, width)} {value}" for name, value in report.environment]
    lines += [rule, f"{title}: features on this machine", rule]
    for feature in report.features:
        mark = yes if feature.available else no
        lines.append(f"{_dots(feature.name, width)} {mark} {feature.detail}")
    if warnings and report.warnings:
        lines += [rule] + [f"[WARNING] {text}" for text in report.warnings]
    lines.append(rule)
    return "\n".join(lines)
