"""Every ``deepspeed`` name the installed Transformers, Accelerate, PEFT (and TRL, when
installed) use resolves in the compatibility package: a release of theirs that needs a new name
fails here, in CI, before a user meets it."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import typing
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


# -- the config edits ---------------------------------------------------------------------------
# Libraries also edit the DeepSpeed config they hand to ``deepspeed.initialize``: TRL's
# prepare_deepspeed adds dotted top-level keys (``"zero_optimization.reduce_bucket_size"``) with
# dict.update, computed from the model's hidden size, and leaves "auto" values in. Every such key
# in a library's source is read here and given to zengine's config reader as TRL gives it.

HIDDEN_SIZE = 64  # what the scanned expressions' ``hidden_size`` stands for


@dataclass(frozen=True)
class DottedKey:
    """A dotted config key written in a dict literal, and its value for `HIDDEN_SIZE` (None
    when the expression is not arithmetic on constants and ``hidden_size``)."""

    key: str
    value: float | None
    file: str
    line: int


def _arithmetic(node: ast.expr) -> float | None:
    """The value of ``hidden_size * hidden_size``, ``0.9 * hidden_size``... (None otherwise)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.Name) and node.id == "hidden_size":
        return HIDDEN_SIZE
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Add):
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if left is None or right is None:
            return None
        return left * right if isinstance(node.op, ast.Mult) else left + right
    return None


def scan_dotted_keys(path: Path, sections: set[str]) -> list[DottedKey]:
    """The dict literals' string keys in `path` of the form ``<section>.<key>``."""
    source = path.read_text(encoding="utf-8", errors="replace")
    if not any(f"{section}." in source for section in sections):
        return []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values, strict=True):
            if (
                isinstance(key, ast.Constant)
                and isinstance(key.value, str)
                and key.value.split(".")[0] in sections
                and "." in key.value
            ):
                found.append(DottedKey(key.value, _arithmetic(value), str(path), key.lineno))
    return found


def _config_sections() -> set[str]:
    from pydantic import BaseModel

    from zengine.config import EngineConfig

    def is_section(annotation: object) -> bool:  # a model, or a model | None
        kinds = typing.get_args(annotation) or (annotation,)
        return any(isinstance(k, type) and issubclass(k, BaseModel) for k in kinds)

    return {name for name, f in EngineConfig.model_fields.items() if is_section(f.annotation)}


def test_the_dotted_key_scan_reads_update_calls(tmp_path: Path) -> None:
    source = tmp_path / "lib.py"
    source.write_text(
        "def prepare(config, hidden_size):\n"
        "    config.update({'zero_optimization.reduce_bucket_size': hidden_size * hidden_size,\n"
        "                   'zero_optimization.stage3_prefetch_bucket_size': 0.9 * hidden_size,\n"
        "                   'zero_optimization.x': max(hidden_size, 1), 'not.a_section': 1})\n"
    )
    found = {(k.key, k.value) for k in scan_dotted_keys(source, {"zero_optimization"})}
    assert found == {
        ("zero_optimization.reduce_bucket_size", HIDDEN_SIZE * HIDDEN_SIZE),
        ("zero_optimization.stage3_prefetch_bucket_size", 0.9 * HIDDEN_SIZE),
        ("zero_optimization.x", None),
    }


def test_the_config_keys_trl_writes_are_read() -> None:
    """TRL's dotted keys, in the config prepare_deepspeed makes for a reference model (the
    Trainer's, "auto" values left in, the optimizer dropped), set the nested keys."""
    sources = installed_sources("trl")
    if not sources:
        pytest.skip("trl is not installed (an optional library here)")
    from zengine.config import load_config

    sections = _config_sections()
    keys = [k for path in sources for k in scan_dotted_keys(path, sections)]
    assert any(k.file.endswith(str(Path("models", "utils.py"))) for k in keys), (
        "no dotted config key found in trl/models/utils.py (prepare_deepspeed): the scan or "
        "TRL changed"
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    values = {k.key: 1000 if k.value is None else k.value for k in keys}
    cfg = load_config({**config, **values}, world_size=1, with_optimizer=False)
    version = importlib.metadata.version("trl")
    for key, value in values.items():
        section, *inner = key.split(".")
        read = getattr(cfg, section)
        for part in inner:
            read = read[part]
        where = next(f"{k.file}:{k.line}" for k in keys if k.key == key)
        assert read == int(value), f"trl {version}'s {key} ({where}): read {read!r}, wrote {value}"
