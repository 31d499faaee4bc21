"""Every ``deepspeed`` name the installed Hugging Face libraries use, read from their sources.

A name is a dotted path rooted at ``deepspeed``: a module imported (``import deepspeed.comm``),
a name imported from one (``from deepspeed.utils import logger``), or an attribute read through
a name such imports bind (``deepspeed.zero.Init``, ``dist.get_rank`` after
``from deepspeed import comm as dist``). Names are resolved per scope, so a function's own
``dist`` (torch.distributed, say) does not count as DeepSpeed's.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Use", "installed_sources", "scan_file", "scan_packages"]

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
