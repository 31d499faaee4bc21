"""The API reference is complete: after ``mkdocs build`` (``nox -s docs``), every name in the
``__all__`` of each package and of each of its public modules (no ``_`` in the dotted path;
for the compatibility ``deepspeed``, whose modules mirror DeepSpeed's tree, the package's own)
has an entry in the built site's inventory (``objects.inv``, which mkdocstrings writes from
what it rendered)."""

from __future__ import annotations

import importlib
import pkgutil
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".docs-site"
PACKAGES = ("zpipe", "zcomm", "zpartition", "zoffload", "zengine")


def _public_modules(package: str) -> list[str]:
    path = importlib.import_module(package).__path__
    found = pkgutil.walk_packages(path, f"{package}.")
    return [package, *(m.name for m in found if "._" not in m.name)]


def _inventory() -> set[str]:
    """The names in the built site's Sphinx inventory (four header lines, then zlib)."""
    data = (SITE / "objects.inv").read_bytes()
    body = zlib.decompress(data.split(b"\n", 4)[4]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines()}


def test_each_package_has_a_page() -> None:
    for package in (*PACKAGES, "deepspeed"):
        pages = [p for p in (ROOT / "docs").glob("*.md") if f"\n::: {package}\n" in p.read_text()]
        assert pages, f"no page renders {package}"


@pytest.mark.parametrize(
    "module", [m for p in PACKAGES for m in _public_modules(p)] + ["deepspeed"]
)
def test_every_public_name_is_in_the_reference(module: str) -> None:
    names = getattr(importlib.import_module(module), "__all__", None)
    if names is None:  # a module of scripts or constants without a public list: its page
        assert module in _inventory()
        return
    # a _name in an __all__ is one of DeepSpeed's private names, kept for its callers: not shown
    public = [n for n in names if n.startswith("__") or not n.startswith("_")]
    missing = sorted({f"{module}.{name}" for name in public} - _inventory())
    assert missing == [], f"public names of {module} missing from the reference"
