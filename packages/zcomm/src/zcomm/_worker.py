"""A pooled test worker: one process that runs test methods as one rank, again and again.

Started by `zcomm._pool` as ``python -m zcomm._worker <fd>``; it talks to the pytest process
over the socket inherited as <fd>, and its stdout and stderr go to a log file that the pytest
process reads after each test. Importing torch once per worker, not once per test, is the
point of the pool.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import torch

import zcomm
from zcomm import _accounting
from zcomm._dist_test import fixture_class

__all__ = ["main"]

# What a fresh process would have: torch's default seed, so tests see the same random numbers
# whichever tests ran in this worker before them.
_TORCH_DEFAULT_SEED = 67280421310721
_DIST_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
)
_modules: dict[str, ModuleType] = {}  # test files already loaded here, by path


def _watch_parent(parent: int) -> None:
    # A worker stuck in a collective must not outlive pytest when pytest is killed.
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(1.0)


def _load_module(name: str, path: str) -> ModuleType:
    module = _modules.get(path)
    if module is None:
        # A benchmark script runs as __main__; load it under another name so that its
        # `if __name__ == "__main__"` block does not run again here.
        as_name = "__zcomm_main__" if name == "__main__" else name
        spec = importlib.util.spec_from_file_location(as_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load test module {name} from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[as_name] = module
        spec.loader.exec_module(module)
        _modules[path] = module
    return module


def _resolve(module: ModuleType, qualname: str) -> Any:
    fixture = fixture_class(module.__name__, qualname)
    if fixture is not None:  # its name in the module is bound to the pytest fixture
        return fixture
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _set_env(task: dict[str, Any]) -> None:
    for name in _DIST_ENV:
        os.environ.pop(name, None)
    if task["set_dist_env"]:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(task["port"]),
            RANK=str(task["rank"]),
            LOCAL_RANK=str(task["rank"]),
            WORLD_SIZE=str(task["world_size"]),
            LOCAL_WORLD_SIZE=str(task["world_size"]),
        )


def _init(task: dict[str, Any]) -> None:
    # A file store, fresh per test: no rank waits for another's TCP server to come up (TCP
    # rendezvous costs a retry, seconds, whenever rank 0 starts last). The timeout bounds
    # both the connection of the ranks and every collective of the test.
    zcomm.init_distributed(
        task["backend"],
        init_method=f"file://{task['store_path']}",
        rank=task["rank"],
        world_size=task["world_size"],
        timeout=task["group_timeout"],
    )


def _outcome(error: BaseException) -> tuple[str, str]:
    outcomes = sys.modules.get("_pytest.outcomes")  # loaded if the test module uses pytest
    if outcomes is not None and isinstance(error, outcomes.Skipped):
        return "skip", str(error)
    if outcomes is not None and isinstance(error, outcomes.XFailed):
        return "xfail", str(error)
    return "error", "".join(traceback.format_exception(error))


def _run(task: dict[str, Any]) -> tuple[str, str, float]:
    """Run one test method as one rank: ("ok" | "error" | "skip" | "xfail" | "setup", text,
    when); "setup" means the process group could not be created, before the test ran.

    `when` is the wall-clock time the outcome was decided here, so the pytest process can
    tell which rank failed first even when the reports reach it together.
    """
    for entry in task["sys_path"]:
        if entry not in sys.path:
            sys.path.append(entry)
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        if not task["reuse"] and zcomm.is_initialized():
            zcomm.destroy()  # a group kept alive by an earlier reuse_dist_env test
        _set_env(task)
        torch.manual_seed(_TORCH_DEFAULT_SEED)
        zcomm.set_activity(zcomm.CALLS[0], 0)  # an earlier test's engine call is not this one's
        if task["init_distributed"] and not zcomm.is_initialized():
            try:
                _init(task)
            except Exception as error:  # before the test ran: the harness may try again
                return "setup", "".join(traceback.format_exception(error)), time.time()
        module = _load_module(task["module"], task["path"])
        cls = _resolve(module, task["qualname"])
        method = getattr(cls, task["method"])
        original = getattr(method, "__zcomm_original__", method)
        kwargs = pickle.loads(task["kwargs"])
        original(cls(), **kwargs)
        return "ok", "", time.time()
    except BaseException as error:  # report everything, even SystemExit, as this rank's result
        return (*_outcome(error), time.time())
    finally:
        if not task["keep_group"]:
            with contextlib.suppress(Exception):
                zcomm.destroy()
        _accounting.enable_comm_accounting(False)
        _accounting.reset_comm_accounting()
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    """Serve tasks from the pytest process until it says stop or goes away."""
    conn = Connection(int(sys.argv[1]))
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    if hasattr(signal, "SIGUSR1"):
        # The pool sends SIGUSR1 to a rank that hangs: dump every thread's stack to the log.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)  # several ranks share a few cores; threads would only contend
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            break
        if task is None:
            break
        conn.send(_run(task))


if __name__ == "__main__":
    main()
