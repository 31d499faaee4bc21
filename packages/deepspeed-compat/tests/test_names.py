"""Every ``deepspeed`` name the installed Transformers, Accelerate, PEFT (and TRL, when
installed) use resolves in the compatibility package: a release of theirs that needs a new name
fails here, in CI, before a user meets it."""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

import pytest

from _scan import Use, installed_sources, scan_file, scan_packages

REQUIRED = ["transformers", "accelerate", "peft"]
OPTIONAL = ["trl"]


def _import(base: str) -> object:
    """What an import statement for `base` gives: the module, or (``from m import x``) the
    attribute x of module m, or its submodule x."""
    try:
        return importlib.import_module(base)
    except ModuleNotFoundError:
        if "." not in base:
            raise
    module, attribute = base.rsplit(".", 1)
    return getattr(importlib.import_module(module), attribute)


def _resolves(use: Use) -> bool:
    """Whether `use` works as at run time: its import succeeds and every attribute read after
    it finds something. A refused stand-in ends the path (its attributes raise where they are
    used, by design)."""
    try:
        obj = _import(use.base)
    except (ImportError, AttributeError):
        return False
    for part in use.name.split(".")[len(use.base.split(".")) :]:
        if getattr(obj, "__zstack_refused__", False):
            return True
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _use(name: str, base: str = "deepspeed") -> Use:
    return Use(name, base, "test", 0)


def test_the_scan_finds_what_libraries_use(tmp_path: Path) -> None:
    """The scanner itself: imports, aliases, attribute chains, and a local name that shadows."""
    source = tmp_path / "lib.py"
    source.write_text(
        "import deepspeed\n"
        "from deepspeed import comm as dist\n"
        "from deepspeed.utils import logger\n"
        "def f():\n"
        "    deepspeed.zero.GatheredParameters([])\n"
        "    dist.get_rank()\n"
        "    logger.setLevel(10)\n"
        "def g():\n"
        "    import torch.distributed as dist\n"
        "    dist.barrier()\n"
        "    import deepspeed.runtime.engine as eng\n"
        "    return eng.DeepSpeedEngine\n"
    )
    assert sorted((u.name, u.base) for u in scan_file(source)) == [
        ("deepspeed", "deepspeed"),
        ("deepspeed.comm", "deepspeed.comm"),
        ("deepspeed.comm.get_rank", "deepspeed.comm"),
        ("deepspeed.runtime.engine", "deepspeed.runtime.engine"),
        ("deepspeed.runtime.engine.DeepSpeedEngine", "deepspeed.runtime.engine"),
        ("deepspeed.utils.logger", "deepspeed.utils.logger"),
        ("deepspeed.utils.logger.setLevel", "deepspeed.utils.logger"),
        ("deepspeed.zero.GatheredParameters", "deepspeed"),
    ]


def test_the_resolver_tells_missing_names() -> None:
    assert _resolves(_use("deepspeed.zero.GatheredParameters"))
    assert _resolves(_use("deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES"))
    sp = "deepspeed.runtime.sequence_parallel.ulysses_sp"
    assert _resolves(_use(f"{sp}.UlyssesSPAttentionHF.x", f"{sp}.UlyssesSPAttentionHF"))
    assert not _resolves(_use("deepspeed.zero.NoSuchName"))
    assert not _resolves(_use("deepspeed.no_such_module.x", "deepspeed.no_such_module"))
    assert not _resolves(_use("deepspeed.utils.no_such_name", "deepspeed.utils.no_such_name"))


@pytest.mark.parametrize("package", REQUIRED)
def test_the_required_libraries_are_installed_and_scanned(package: str) -> None:
    assert installed_sources(package), f"{package} is not installed: nothing was checked"
    assert any(True for _ in scan_packages([package])), f"no deepspeed use found in {package}"


def test_every_name_the_libraries_use_resolves() -> None:
    packages = REQUIRED + [p for p in OPTIONAL if installed_sources(p)]
    missing: dict[str, Use] = {}
    for use in scan_packages(packages):
        if use.name not in missing and not _resolves(use):
            missing[use.name] = use
    versions = {p: importlib.metadata.version(p) for p in packages}
    assert not missing, f"names the compatibility package lacks ({versions}):\n" + "\n".join(
        f"  {name}  (first at {use.file}:{use.line})" for name, use in sorted(missing.items())
    )
