"""One rank's start under zstack's launcher: torchrun's worker runs this file (by path, so it
imports only the standard library), which turns itself into the user's script.

``_rank.py --mode=python|module|exec [--local_rank] [--log_dir DIR --log_prefix P]
[--bind_cores LIST|all] [--mpi] -- SCRIPT ARGS`` (``python -u SCRIPT``, ``python -u -m
SCRIPT``, or the script itself): with ``--local_rank`` the script gets
``--local_rank=N`` before its own arguments, as DeepSpeed's launcher passes it; ``--log_dir``
sends the rank's stdout and stderr to ``DIR/P_rank{RANK}.log`` (DeepSpeed's names);
``--bind_cores`` gives each local rank an equal share of the cores (the listed ones, or all this
process may use) and sets ``OMP_NUM_THREADS`` to its size. Then ``exec``: torchrun watches the
same process id.

Under an MPI launcher (``--mpi``) there is no torchrun: the shim first sets torch's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from the MPI launcher's own variables
(`mpi_env`: Open MPI's, MVAPICH2's, Hydra's for MPICH and Intel MPI, PMIx/PALS), so the script,
zcomm, Accelerate and torch.distributed all see the world they would under torchrun.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence


def parse_core_list(text: str) -> list[int]:
    """``"0,2-4"`` -> ``[0, 2, 3, 4]`` (DeepSpeed's ``--bind_core_list`` format: single cores
    and ``N-M`` ranges, in ascending order and not overlapping, as DeepSpeed's launcher
    requires); anything else raises `ValueError` naming the part at fault."""
    cores: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"--bind_core_list {text!r}: {part!r} is not N or N-M")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"--bind_core_list {text!r}: range {part!r} ends before it starts")
        if cores and first <= cores[-1]:
            raise ValueError(
                f"--bind_core_list {text!r}: {part!r} overlaps or comes before the cores listed "
                "ahead of it; list them in ascending order"
            )
        cores += range(first, last + 1)
    return cores


# Each torch variable and, in order, the MPI launchers' variables it is read from: Open MPI,
# MVAPICH2, Hydra (MPICH, Intel MPI), PMIx / Cray PALS; for the sizes, then the launcher's own
# -genv WORLD_SIZE / LOCAL_SIZE (zstack's mpich and impi commands export them, as DeepSpeed's).
MPI_ENV_SOURCES: dict[str, tuple[str, ...]] = {
    "RANK": ("OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
    "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE"),
    "LOCAL_RANK": (
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "PALS_LOCAL_RANKID",
    ),
    "LOCAL_WORLD_SIZE": (
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MV2_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "PALS_LOCAL_SIZE",
        "LOCAL_SIZE",
    ),
}


def mpi_env(environ: Mapping[str, str]) -> dict[str, str]:
    """torch's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (and DeepSpeed's
    ``LOCAL_SIZE``) from an MPI launcher's variables in ``environ``; one that no launcher set,
    or a value that is not a count, raises `ValueError` naming the variables looked for."""
    out: dict[str, str] = {}
    for name, sources in MPI_ENV_SOURCES.items():
        found = next((source for source in sources if source in environ), None)
        if found is None:
            raise ValueError(
                f"zcomm.launch under MPI: {name} not found; none of {', '.join(sources)} is set "
                "(is this process started by mpirun?)"
            )
        if not environ[found].strip().isdigit():
            raise ValueError(f"zcomm.launch under MPI: {found}={environ[found]!r} is not a count")
        out[name] = environ[found].strip()
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if int(out[rank]) >= int(out[size]):
            raise ValueError(
                f"zcomm.launch under MPI: {rank}={out[rank]} is not below {size}={out[size]}"
            )
    out["LOCAL_SIZE"] = out["LOCAL_WORLD_SIZE"]
    return out


def cores_for(cores: Sequence[int], local_rank: int, local_size: int) -> list[int]:
    """This local rank's equal share of ``cores`` (the remainder goes unused, as DeepSpeed)."""
    per_rank = len(cores) // local_size
    if per_rank < 1:
        raise ValueError(
            f"--bind_cores_to_rank: {len(cores)} core(s) for {local_size} local ranks; "
            "each rank needs at least one"
        )
    return list(cores[per_rank * local_rank : per_rank * (local_rank + 1)])


def rank_argv(
    script: str,
    script_args: Sequence[str],
    local_rank: int | None,
    module: bool,
    no_python: bool,
    python: str,
) -> list[str]:
    """The argv the rank execs (``local_rank`` ``None``: not passed)."""
    passed = [] if local_rank is None else [f"--local_rank={local_rank}"]
    if no_python:
        return [script, *passed, *script_args]
    return [python, "-u", *(["-m"] if module else []), script, *passed, *script_args]


def main(argv: Sequence[str]) -> None:
    if "--" not in argv:
        raise SystemExit("zcomm.launch rank shim: expected '-- SCRIPT ARGS'")
    split = list(argv).index("--")
    parser = argparse.ArgumentParser(prog="zcomm.launch rank shim")
    parser.add_argument("--mode", choices=["python", "module", "exec"], required=True)
    parser.add_argument("--local_rank", action="store_true")
    parser.add_argument("--log_dir", default=None)
    parser.add_argument("--log_prefix", default="")
    parser.add_argument("--bind_cores", default=None)
    parser.add_argument("--mpi", action="store_true")
    opts = parser.parse_args(argv[:split])
    script, *script_args = argv[split + 1 :]
    if opts.mpi:
        try:
            os.environ.update(mpi_env(os.environ))
        except ValueError as error:
            raise SystemExit(str(error)) from None
    local_rank = int(os.environ["LOCAL_RANK"])
    if opts.bind_cores is not None:
        if opts.bind_cores == "all":
            cores = sorted(os.sched_getaffinity(0))
        else:
            cores = parse_core_list(opts.bind_cores)
        mine = cores_for(cores, local_rank, int(os.environ["LOCAL_WORLD_SIZE"]))
        os.sched_setaffinity(0, mine)  # kept across exec
        os.environ["OMP_NUM_THREADS"] = str(len(mine))
    if opts.log_dir is not None:
        path = os.path.join(opts.log_dir, f"{opts.log_prefix}_rank{os.environ['RANK']}.log")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    args = rank_argv(
        script,
        script_args,
        local_rank if opts.local_rank else None,
        opts.mode == "module",
        opts.mode == "exec",
        sys.executable,
    )
    if opts.mode == "exec":
        os.execvp(args[0], args)
    os.execv(sys.executable, args)


if __name__ == "__main__":
    main(sys.argv[1:])
