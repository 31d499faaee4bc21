"""Start-up and the questions every rank asks: who am I, how many are we, tear down.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). With no such environment it starts a world of one inside this process on an
in-memory store, so a script runs with plain ``python`` and no port is opened.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, Store, TCPStore

from zcomm import _watchdog
from zcomm._accelerator import get_accelerator

__all__ = [
    "destroy",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "group_size",
    "init_distributed",
    "is_initialized",
    "on_destroy",
]

# DeepSpeed's default: long enough for a slow first compile or checkpoint load on one rank.
DEFAULT_TIMEOUT = timedelta(minutes=30)
log = logging.getLogger("zcomm")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Callbacks that drop per-process-group caches (groups, topology groups) on `destroy`.
_destroy_hooks: list[Callable[[], None]] = []
_teardown_registered = False  # `destroy` runs at exit once a world was started here


def on_destroy(hook: Callable[[], None]) -> None:
    """Register `hook` to run when `destroy` tears the process group down."""
    _destroy_hooks.append(hook)


def _resolve_backend(backend: str | None, dist_backend: str | None) -> str | None:
    if backend is not None and dist_backend is not None and backend != dist_backend:
        raise ValueError(
            f"init_distributed: backend={backend!r} and dist_backend={dist_backend!r} disagree; "
            "pass one of them"
        )
    chosen = backend if backend is not None else dist_backend
    if chosen is None:
        return None
    if not isinstance(chosen, str) or not chosen:
        raise ValueError(f"init_distributed(backend=...): expected a backend name, got {chosen!r}")
    return chosen.lower()


def _resolve_timeout(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (timedelta, int, float)):
        raise TypeError(
            f"init_distributed(timeout=...): expected a timedelta or seconds, got {timeout!r}"
        )
    result = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    if result.total_seconds() <= 0:
        raise ValueError(f"init_distributed(timeout=...): must be positive, got {timeout!r}")
    return result


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _check_rank(rank: int, world_size: int, source: str) -> None:
    if world_size < 1:
        raise ValueError(f"{source}: world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{source}: rank must be in [0, {world_size}), got {rank}")


def _torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) from torchrun's variables; None when there is no launcher."""
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present or present == ["MASTER_ADDR"] or present == ["MASTER_PORT"]:
        return None
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"init_distributed: the launcher environment is incomplete: {', '.join(missing)} "
            f"not set (found {', '.join(present)})"
        )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    _check_rank(rank, world_size, "environment RANK/WORLD_SIZE")
    return rank, world_size


# (rank, world size, local rank) variables of MPI launchers: Open MPI's, then MPICH / Intel MPI's
_MPI_VARS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


def _mpi_env(port: int) -> bool:
    """Under ``mpirun`` without torchrun's variables, set them from the MPI launcher's (as
    DeepSpeed's ``auto_mpi_discovery``); whether an MPI launch was found."""
    found = [names for names in _MPI_VARS if names[0] in os.environ and names[1] in os.environ]
    if not found:
        return False
    rank_var, size_var, local_var = found[0]
    rank, world_size = _env_int(rank_var), _env_int(size_var)
    _check_rank(rank, world_size, f"environment {rank_var}/{size_var}")
    if world_size > 1 and "MASTER_ADDR" not in os.environ:
        # DeepSpeed asks rank 0 for its address over mpi4py, which zcomm does not depend on.
        raise ValueError(
            f"init_distributed: an MPI launch ({rank_var}={rank}, {size_var}={world_size}) "
            "without MASTER_ADDR: set it to the first rank's host (mpirun -x MASTER_ADDR=...), "
            "or launch with torchrun"
        )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_RANK"] = os.environ.get(local_var, "0")
    return True


def init_distributed(
    backend: str | None = None,
    *,
    timeout: timedelta | float | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    dist_backend: str | None = None,
    dist_init_required: bool | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    config: object = None,
    watchdog: float | None = None,
) -> None:
    """Start torch.distributed for this process; harmless when it is already started.

    Args:
        backend: ``"nccl"`` or ``"gloo"`` (any torch backend); by default NCCL when CUDA is
            there, gloo otherwise. ``dist_backend`` is DeepSpeed's name for it.
        timeout: how long a collective may wait before it raises (timedelta or seconds).
        init_method: a torch rendezvous URL (``tcp://host:port``, ``file://path``); needs
            `rank` and `world_size`. Without it the torchrun environment is read, and with no
            environment at all a world of one starts in this process.
        rank, world_size: this process's rank and the number of processes, with `init_method`
            (DeepSpeed's -1 means not given).
        dist_init_required: DeepSpeed's flag: ``False`` means the caller started
            torch.distributed already; if it did not, that is an error.
        auto_mpi_discovery: under ``mpirun`` (Open MPI, MPICH, Intel MPI) with no torchrun
            variables, read rank and world size from the MPI launcher's; MASTER_ADDR must be
            set when there are several ranks.
        distributed_port: the MASTER_PORT an MPI launch uses when none is set (DeepSpeed's).
        verbose, config: DeepSpeed's; nothing here depends on them.
        watchdog: seconds a rank may stay silent (frozen, unreachable) while another waits
            for it in a host collective before it is named in an error, and how long ranks
            may wait in different collectives before they are ([Note: the watchdog]); 0
            turns the checks off. Default: ``ZCOMM_WATCHDOG``, else 30.
    """
    if watchdog is not None:
        _watchdog.set_watchdog(watchdog)
    rank = None if rank == -1 else rank
    world_size = None if world_size == -1 else world_size
    chosen = _resolve_backend(backend, dist_backend)
    if dist.is_initialized():
        current = str(dist.get_backend())
        if chosen is not None and chosen not in current.split(":") and chosen != current:
            # the caller wants a world, and one is up: keep it, as DeepSpeed does (scripts
            # ask for "nccl" unconditionally, and run on CPU under a gloo launcher)
            log.warning(
                "zcomm: init_distributed(backend=%r): already initialized with backend %r; "
                "keeping it",
                chosen,
                current,
            )
        return
    if dist_init_required is False:
        raise RuntimeError(
            "init_distributed(dist_init_required=False): torch.distributed is not initialized; "
            "start it first (torch.distributed.init_process_group), or leave "
            "dist_init_required out to let zcomm start it"
        )
    if chosen == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "init_distributed(backend='nccl'): NCCL needs CUDA, and no CUDA device is visible"
        )
    wait = _resolve_timeout(timeout)
    chosen = chosen or get_accelerator().communication_backend_name()
    if init_method is not None:
        if rank is None or world_size is None:
            raise ValueError(
                "init_distributed(init_method=...): rank and world_size are required too"
            )
        _check_rank(rank, world_size, "init_distributed(rank=..., world_size=...)")
        _start(chosen, wait, rank, world_size, init_method=init_method)
        return
    if (rank is None) != (world_size is None):
        raise ValueError("init_distributed: pass rank and world_size together")
    env = _torchrun_env()
    if env is None and auto_mpi_discovery and rank is None and _mpi_env(distributed_port):
        env = _torchrun_env()
    if rank is not None and world_size is not None:
        _check_rank(rank, world_size, "init_distributed(rank=..., world_size=...)")
        if env is None and world_size > 1:
            raise ValueError(
                f"init_distributed(world_size={world_size}): no launcher environment "
                "(MASTER_ADDR/MASTER_PORT) and no init_method to meet the other ranks"
            )
        env = (rank, world_size) if env is not None else None
    if env is None:
        _start(chosen, wait, 0, 1, store=HashStore())  # the embedded world of one
    elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
        _start(chosen, wait, env[0], env[1], store=_elastic_store(env[0], env[1], wait))
    else:
        _start(chosen, wait, env[0], env[1], init_method="env://")


def _elastic_store(rank: int, world_size: int, timeout: timedelta) -> Store:
    """torchrun's store, with the keys of this attempt apart from a failed one's.

    Under ``torchrun --max-restarts`` the agent keeps one store for every attempt, and torch's
    env:// rendezvous does not separate the attempts' keys: a restarted rank may read the
    address a dead rank left there and fail to connect (seen about one restart in three with
    torch 2.13). A prefix per attempt (TORCHELASTIC_RESTART_COUNT) keeps them apart.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT"),
        world_size,
        is_master=not agent and rank == 0,  # the agent hosts it, or else rank 0 does
        timeout=timeout,
    )
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return PrefixStore(f"zcomm/attempt{attempt}", store)


def _start(
    backend: str,
    timeout: timedelta,
    rank: int,
    world_size: int,
    *,
    init_method: str | None = None,
    store: Store | None = None,
) -> None:
    if backend == "nccl":
        # One GPU per rank on a node; set it before NCCL creates its communicator.
        torch.cuda.set_device(get_local_rank() % max(torch.cuda.device_count(), 1))
    dist.init_process_group(
        backend,
        init_method=init_method,
        store=store,
        timeout=timeout,
        rank=rank,
        world_size=world_size,
    )
    # [Note: works released at exit]
    # gloo's worker thread lets go of a work after it finished it; a work whose Python side
    # is garbage in a reference cycle is freed by the interpreter's last collection, and if
    # the worker's release comes after that, the thread needs the GIL of an interpreter that
    # is shutting down and the process aborts ("terminate called without an active
    # exception"): torchrun then counts a finished job as failed and may restart it. Seen in
    # 5-14% of the runs of a 2-rank zengine job on this 2-core machine (a core dump showed
    # the worker in ~AsyncAllreduceWork); with the collection and the teardown done at exit,
    # while the interpreter still runs, 0 of 100. A script that called destroy() loses nothing.
    _watchdog.start()
    global _teardown_registered
    if not _teardown_registered:
        atexit.register(_teardown)
        _teardown_registered = True


def _teardown() -> None:
    """At exit, while the interpreter still runs: collect the garbage that holds finished
    works (their release needs the GIL), then tear the groups down."""
    gc.collect()
    destroy()


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _require_init(caller: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"zcomm.{caller}(): call zcomm.init_distributed() first")


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in `group` (the world by default); -1 if not a member."""
    _require_init("get_rank")
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """The number of ranks in `group` (the world by default)."""
    _require_init("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node (LOCAL_RANK from the launcher; 0 without one)."""
    return _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0


def group_size(caller: str, group: dist.ProcessGroup | None) -> int:
    """The size of `group` for an operation named `caller`, which needs a started world."""
    _require_init(caller)
    return dist.get_world_size(group)


def destroy() -> None:
    """Tear down every process group and zcomm's caches of them; harmless when not started."""
    _watchdog.stop()
    _watchdog.set_activity(_watchdog.CALLS[0], 0)  # the next world starts with no engine call
    for hook in _destroy_hooks:
        hook()
    if is_initialized():
        dist.destroy_process_group()
