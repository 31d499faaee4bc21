"""One rank's start under zstack's launcher: torchrun's worker runs this file (by path, so it
imports only the standard library), which turns itself into the user's script.

``_rank.py --mode=python|module|exec [--local_rank] [--log_dir DIR --log_prefix P]
[--bind_cores LIST|all] -- SCRIPT ARGS`` (``python -u SCRIPT``, ``python -u -m SCRIPT``, or the
script itself): with ``--local_rank`` the script gets
``--local_rank=N`` before its own arguments, as DeepSpeed's launcher passes it; ``--log_dir``
sends the rank's stdout and stderr to ``DIR/P_rank{RANK}.log`` (DeepSpeed's names);
``--bind_cores`` gives each local rank an equal share of the cores (the listed ones, or all this
process may use) and sets ``OMP_NUM_THREADS`` to its size. Then ``exec``: torchrun watches the
same process id.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def parse_core_list(text: str) -> list[int]:
    """``"0,2-4"`` -> ``[0, 2, 3, 4]`` (DeepSpeed's ``--bind_core_list`` format)."""
    cores: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"--bind_core_list {text!r}: {part!r} is not N or N-M")
        cores += range(int(low), int(high) + 1) if dash else [int(low)]
    return cores


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
    opts = parser.parse_args(argv[:split])
    script, *script_args = argv[split + 1 :]
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
