"""Every ``deepspeed`` name the installed Transformers, Accelerate, PEFT (and TRL, when
installed) use resolves in the compatibility package: a release of theirs that needs a new name
fails here, in CI, before a user meets it."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REQUIRED = ["transformers", "accelerate", "peft"]
OPTIONAL = ["trl"]


# -- the scanner --------------------------------------------------------------------------------
# Every ``deepspeed`` name the installed Hugging Face libraries use, read from their sources.
#
# A name is a dotted path rooted at ``deepspeed``: a module imported (``import deepspeed.comm``),
# a name imported from one (``from deepspeed.utils import logger``), or an attribute read through
# a name such imports bind (``deepspeed.zero.Init``, ``dist.get_rank`` after
# ``from deepspeed import comm as dist``). Names are resolved per scope, so a function's own
# ``dist`` (torch.distributed, say) does not count as DeepSpeed's.

ROOT = "deepspeed"


@dataclass(frozen=True)
class Use:
    """One name used at one place: `name` is reached from `base`, what the import statement
    itself imports (a module, or a module's attribute for ``from ... import``), by attribute
    reads only, as at run time."""

    name: str
    base: str
    file: str
    line: int


def installed_sources(package: str) -> list[Path]:
    """The .py files of an installed package (none when it is not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(
        f for location in spec.submodule_search_locations for f in Path(location).rglob("*.py")
    )


class _Scanner(ast.NodeVisitor):
    def __init__(self, file: str) -> None:
        self.file = file
        # name -> (deepspeed path it is bound to, what its import imported), or None
        self.scopes: list[dict[str, tuple[str, str] | None]] = [{}]
        self.uses: list[Use] = []

    def _use(self, name: str, base: str, node: ast.AST) -> None:
        self.uses.append(Use(name, base, self.file, getattr(node, "lineno", 0)))

    def _bind(self, name: str, bound: tuple[str, str] | None) -> None:
        self.scopes[-1][name] = bound

    def _lookup(self, name: str) -> tuple[str, str] | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def _scoped(self, node: ast.AST) -> None:
        # imports anywhere in a function bind for all of it (Python's rule), so collect first
        scope: dict[str, tuple[str, str] | None] = {}
        self.scopes.append(scope)
        for child in ast.walk(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                self._imports(child, record=False)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scoped

    def visit_Import(self, node: ast.Import) -> None:
        self._imports(node, record=True)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self._imports(node, record=True)

    def _imports(self, node: ast.Import | ast.ImportFrom, *, record: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top == ROOT:
                    if record:
                        self._use(alias.name, alias.name, node)
                    # `import deepspeed.a.b` binds `deepspeed`, and imports deepspeed.a.b
                    path = alias.name if alias.asname else top
                    self._bind(alias.asname or top, (path, alias.name))
                else:
                    self._bind(alias.asname or top, None)
            return
        module = node.module or ""
        if node.level or module.split(".")[0] != ROOT:
            for alias in node.names:
                self._bind(alias.asname or alias.name, None)
            return
        for alias in node.names:
            if alias.name == "*":
                if record:
                    self._use(module, module, node)
                continue
            path = f"{module}.{alias.name}"
            if record:
                self._use(path, path, node)
            self._bind(alias.asname or alias.name, (path, path))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parts: list[str] = []
        inner: ast.expr = node
        while isinstance(inner, ast.Attribute):
            parts.append(inner.attr)
            inner = inner.value
        if isinstance(inner, ast.Name):
            bound = self._lookup(inner.id)
            if bound is not None:
                path, base = bound
                self._use(".".join([path, *reversed(parts)]), base, node)
                return  # the inner attributes are prefixes of this one
        self.generic_visit(node)


def scan_file(path: Path) -> list[Use]:
    """The deepspeed names `path` uses (none for a file that does not parse)."""
    source = path.read_text(encoding="utf-8", errors="replace")
    if ROOT not in source:
        return []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    scanner = _Scanner(str(path))
    for child in tree.body:  # module-level imports bind before functions run
        if isinstance(child, ast.Import | ast.ImportFrom):
            scanner._imports(child, record=False)
    scanner.visit(tree)
    return scanner.uses


def scan_packages(packages: list[str]) -> Iterator[Use]:
    """Every use in every installed package of `packages`."""
    for package in packages:
        for path in installed_sources(package):
            yield from scan_file(path)


# -- the tests --------------------------------------------------------------------------------


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
