"""`DistributedTest`: each test method of a subclass runs in `world_size` processes.

DeepSpeed's harness (``unit.common.DistributedTest``) under plain pytest, without a conftest:
subclassing wraps every ``test*`` method so that calling it (pytest does) sends the method to
pooled worker processes, one per rank, and turns their outcomes back into a pytest outcome.
Fixture values and parametrize arguments travel to the ranks by pickle; the method itself is
found again in each worker by its module file and qualified name.
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

import torch

from zcomm._pool import RankResult, _Worker, free_port, pool

# Under pytest, pytest is imported before any test module; elsewhere (a benchmark, a lean
# import) the harness neither needs nor imports it.
pytest: Any = sys.modules.get("pytest")

__all__ = ["DistributedFixture", "DistributedTest", "fixture_class"]

_DEFAULT_TIMEOUT = float(os.environ.get("ZCOMM_TEST_TIMEOUT", "300"))
_GROUP_TIMEOUT = 120.0  # seconds: a test's connection and each of its collectives
_SETUP_ATTEMPTS = 2  # a test whose ranks cannot connect runs once more on fresh workers


def _fail(message: str) -> NoReturn:
    try:
        import pytest
    except ImportError:  # used outside pytest (a benchmark): a plain error says the same
        raise AssertionError(message) from None
    pytest.fail(message, pytrace=False)


def _skip(message: str, *, xfail: bool) -> NoReturn:
    import pytest

    if xfail:
        pytest.xfail(message)
    pytest.skip(message)


def _world_sizes(value: Any, where: str) -> list[int]:
    sizes = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(sizes, (list, tuple)) or not sizes:
        raise TypeError(f"{where}: world_size must be an int or a list of ints, got {value!r}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{where}: world_size must be a positive int, got {size!r}")
    return list(sizes)


def _default_backend(world_size: int) -> str:
    # NCCL needs a GPU per rank; tests of more ranks than GPUs run on gloo.
    if torch.cuda.is_available() and world_size <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


class _DistributedExec:
    """What runs on several ranks, and how (the attributes of `DistributedTest`)."""

    world_size: int | Sequence[int] = 2
    init_distributed: bool = True
    set_dist_env: bool = True
    reuse_dist_env: bool = False
    backend: str | None = None
    exec_timeout: float = _DEFAULT_TIMEOUT
    failure_grace: float = 10.0


class DistributedTest(_DistributedExec):
    """Base class of tests whose methods run in several processes at once.

    Class attributes (DeepSpeed's names):
        world_size: ranks per test, or a list of sizes to run each test at in turn. A test
            method may also take a ``world_size`` parameter (``pytest.mark.parametrize``) or
            carry ``@pytest.mark.world_size(n)``; both override the class attribute.
        init_distributed: start zcomm (``zcomm.init_distributed``) before the test body.
        set_dist_env: set torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).
        reuse_dist_env: keep the process group alive for the next test of the same size.
        backend: ``None`` for NCCL when every rank can have a GPU, gloo otherwise.
        exec_timeout: seconds before a test that has not finished is killed (default 300,
            or ``ZCOMM_TEST_TIMEOUT``); the failure names the test and the stuck ranks.
        failure_grace: seconds the other ranks get to finish once one rank has failed.

    The class-scoped fixture ``class_tmpdir`` (DeepSpeed's) is a directory the tests of one
    class, and the `DistributedFixture` they use, share.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            if name.startswith("test") and inspect.isfunction(value):
                setattr(cls, name, _distributed(value))

    if pytest is not None:

        @pytest.fixture(scope="class")  # type: ignore[untyped-decorator]  # pytest: Any here
        @classmethod
        def class_tmpdir(cls, tmpdir_factory: Any) -> Any:
            """A directory shared by the tests of this class (a ``py.path``, as DeepSpeed's)."""
            return tmpdir_factory.mktemp(cls.__name__)


_FIXTURES: dict[tuple[str, str], type[DistributedFixture]] = {}


def fixture_class(module: str, qualname: str) -> type[DistributedFixture] | None:
    """The `DistributedFixture` subclass defined as `qualname` in `module`, if one is."""
    return _FIXTURES.get((module, qualname))


class _FixtureMaker(type):
    """Makes each subclass of `DistributedFixture` a pytest fixture of the class's name."""

    def __new__(
        mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any
    ) -> Any:
        cls = super().__new__(mcs, name, bases, namespace, **kwargs)
        if not any(isinstance(base, _FixtureMaker) for base in bases):
            return cls  # DistributedFixture itself
        return _as_fixture(cast("type[DistributedFixture]", cls))


class DistributedFixture(_DistributedExec, metaclass=_FixtureMaker):
    """A pytest fixture whose ``run`` method runs on `world_size` ranks (DeepSpeed's).

    ``class saved_checkpoint(DistributedFixture)`` with ``world_size = 2`` and
    ``def run(self, class_tmpdir, ...)`` defines the fixture ``saved_checkpoint``: a test
    that asks for it gets it run first, on its own ranks, with the fixtures ``run`` asks for
    (parametrized ones make the test parametrized), so work of one world size (writing a
    checkpoint) can be checked at another. The class statement binds the fixture, not the
    class; `world_size` is one int; the other attributes are `DistributedTest`'s.
    """


def _as_fixture(cls: type[DistributedFixture]) -> Any:
    import pytest

    where = f"{cls.__qualname__} (a DistributedFixture)"
    if isinstance(cls.world_size, bool) or not isinstance(cls.world_size, int):
        raise TypeError(f"{where}: world_size must be one int, got {cls.world_size!r}")
    _world_sizes(cls.world_size, where)
    run = getattr(cls, "run", None)
    if not inspect.isfunction(run):
        raise TypeError(f"{where}: define run(self, <the fixtures it needs>)")
    wanted = list(inspect.signature(run).parameters.values())[1:]  # after self
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in wanted):
        raise TypeError(f"{where}: run() takes fixtures by name only, not *args or **kwargs")
    module, _ = _locate(cls)
    _FIXTURES[(module, cls.__qualname__)] = cls

    def run_on_ranks(**fixtures: Any) -> None:
        _run(cls, "run", fixtures, cast(int, cls.world_size))

    run_on_ranks.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [p.replace(kind=p.POSITIONAL_OR_KEYWORD, default=p.empty) for p in wanted]
    )
    run_on_ranks.__name__ = run_on_ranks.__qualname__ = cls.__name__
    run_on_ranks.__module__ = cls.__module__
    run_on_ranks.__doc__ = cls.__doc__
    return pytest.fixture(name=cls.__name__)(run_on_ranks)


def _distributed(fn: Callable[..., Any]) -> Callable[..., None]:
    @functools.wraps(fn)
    def run_on_ranks(self: DistributedTest, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        where = f"{cls.__name__}.{fn.__name__}"
        if args:
            raise TypeError(f"{where}: pass test arguments by name (pytest does)")
        sizes = _marked_world_size(fn)
        if sizes is None:
            sizes = kwargs.get("world_size", cls.world_size)
        for size in _world_sizes(sizes, where):
            _run(cls, fn.__name__, kwargs, size)

    run_on_ranks.__zcomm_original__ = fn  # type: ignore[attr-defined]
    return run_on_ranks


def _marked_world_size(fn: Callable[..., Any]) -> Any:
    for mark in getattr(fn, "pytestmark", []):
        if getattr(mark, "name", None) == "world_size" and mark.args:
            return mark.args[0]
    return None


def _locate(cls: type) -> tuple[str, str]:
    if "<locals>" in cls.__qualname__:
        kind = "DistributedFixture" if isinstance(cls, _FixtureMaker) else "DistributedTest"
        raise TypeError(f"{cls.__qualname__}: a {kind} must be defined at module level")
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if path is None:
        raise TypeError(f"{cls.__qualname__}: cannot find the file of module {cls.__module__}")
    return cls.__module__, os.path.abspath(path)


def _pickled(where: str, kwargs: dict[str, Any]) -> bytes:
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as error:
            raise TypeError(
                f"{where}: argument {name!r} ({type(value).__name__}) cannot be sent to the "
                f"ranks (it does not pickle: {error})"
            ) from None
    return pickle.dumps(kwargs)


def _run(cls: type[_DistributedExec], method: str, kwargs: dict[str, Any], world_size: int) -> None:
    where = f"{cls.__qualname__}::{method} (world_size={world_size})"
    module, path = _locate(cls)
    the_pool = pool()
    test = {
        "module": module,
        "path": path,
        "qualname": cls.__qualname__,
        "method": method,
        "kwargs": _pickled(where, kwargs),
        "world_size": world_size,
        "backend": cls.backend or _default_backend(world_size),
        "init_distributed": cls.init_distributed,
        "set_dist_env": cls.set_dist_env,
        "keep_group": cls.reuse_dist_env,
        "group_timeout": min(cls.exec_timeout, _GROUP_TIMEOUT),
        "sys_path": list(sys.path),
    }
    for attempt in range(_SETUP_ATTEMPTS):
        workers = the_pool.acquire(world_size)
        results = _attempt(cls, test, workers)
        if attempt + 1 < _SETUP_ATTEMPTS and any(_could_not_connect(r) for r in results):
            # [Note: connection retries] The ranks could not connect: gloo's full-mesh
            # connection of a new group is now and then closed by the peer on a busy machine
            # (gloo itself added connection retries later). The test runs once more on fresh
            # workers; a second failure is reported, so a real connection bug still shows.
            the_pool.discard(workers)
            warnings.warn(
                f"{where}: its ranks could not connect; ran it again on fresh workers",
                RuntimeWarning,
                stacklevel=1,
            )
            continue
        break
    _echo_logs(results)
    _report(where, results, cls.exec_timeout)


def _could_not_connect(result: RankResult) -> bool:
    """A rank that could not create its process group, or a group within the test."""
    if result.status == "setup":
        return True
    return result.status == "error" and "Gloo connectFullMesh failed" in result.text


def _attempt(
    cls: type[_DistributedExec], test: dict[str, Any], workers: list[_Worker]
) -> list[RankResult]:
    """Run the test once on `workers`, with a fresh rendezvous."""
    the_pool = pool()
    reuse = cls.reuse_dist_env and _shared_group(workers, test["world_size"])
    group_id = (
        workers[0].live_group
        if reuse
        else (the_pool.new_group_id() if cls.reuse_dist_env else None)
    )
    base = dict(
        test,
        port=free_port(),  # for tests that start zcomm themselves from the environment
        store_path=the_pool.new_store_path(),
        reuse=reuse,
    )
    tasks = [dict(base, rank=rank) for rank in range(test["world_size"])]
    results = the_pool.run(workers, tasks, timeout=cls.exec_timeout, grace=cls.failure_grace)
    ok = all(r.status in ("ok", "skip", "xfail") for r in results)
    for worker in workers:
        worker.live_group = group_id if ok else None
    return results


def _shared_group(workers: list[_Worker], world_size: int) -> bool:
    """Whether the first `world_size` workers hold one live group of exactly that size."""
    ids = {w.live_group for w in workers}
    if len(ids) != 1 or None in ids:
        return False
    return all(w.live_group not in ids for w in pool()._workers[world_size:] if w is not None)


def _echo_logs(results: list[RankResult]) -> None:
    # Printed in the pytest process, so pytest captures it and shows it with a failure.
    for r in results:
        for line in r.log.splitlines():
            print(f"[rank {r.rank}] {line}")


def _report(where: str, results: list[RankResult], timeout: float) -> None:
    failed = [r for r in results if r.status in ("error", "died", "setup")]
    hung = [r for r in results if r.status == "hung"]
    if not failed and not hung:
        skipped = [r for r in results if r.status in ("skip", "xfail")]
        if skipped:
            _skip(f"rank {skipped[0].rank}: {skipped[0].text}", xfail=skipped[0].status == "xfail")
        return
    parts = [f"{where} failed:"]
    for r in sorted(failed, key=lambda r: r.finished_at):  # the first to fail is the likely cause
        if r.status == "setup":
            parts.append(
                f"rank {r.rank} could not set up its process group "
                f"({_SETUP_ATTEMPTS} attempts, fresh workers each time):\n{r.text.rstrip()}"
            )
        elif r.status == "died":
            parts.append(
                f"rank {r.rank} {r.text} (its output is shown above with a [rank {r.rank}] prefix)"
            )
        else:
            parts.append(f"rank {r.rank} raised:\n{r.text.rstrip()}")
    if hung:
        ranks = ", ".join(str(r.rank) for r in hung)
        parts.append(
            f"rank {ranks} did not finish within {timeout:g} s and "
            f"{'was' if len(hung) == 1 else 'were'} killed"
            if not failed
            else f"rank {ranks} still running after the failure above and "
            f"{'was' if len(hung) == 1 else 'were'} killed"
        )
        for r in hung:
            stack = _stack_of(r.log)
            if stack:
                parts.append(f"rank {r.rank} was here:\n{stack}")
    _fail("\n\n".join(parts))


def _stack_of(log: str) -> str:
    """The stack dump faulthandler wrote into a hung rank's log, if any."""
    found = [i for i in (log.find("Current thread 0x"), log.find("Thread 0x")) if i >= 0]
    return log[min(found) :].rstrip() if found else ""
