"""``deepspeed.env_report``: ``ds_report``, DeepSpeed's environment report, for zstack.

It says plainly that this ``deepspeed`` is zstack's compatibility package, then prints
zengine's report (`zengine.report`, what ``zengine report`` prints: zstack's packages,
torch and what it was built with, and each feature this machine has or lacks, with the
reason), and, unless ``--hide_operator_status``, DeepSpeed's op table: zstack builds none of
DeepSpeed's C++/CUDA ops, and each line says what stands in for the op.
``--hide_errors_and_warnings`` leaves out the warnings (a small /dev/shm).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from deepspeed.__about__ import __version__
from deepspeed.ops.op_builder import (
    AsyncIOBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    FusedAdamBuilder,
    FusedLionBuilder,
    OpBuilder,
)
from zengine.report import collect, format_report

__all__ = ["cli_main", "debug_report", "main", "op_report", "parse_arguments"]

_BUILDERS: tuple[type[OpBuilder], ...] = (
    AsyncIOBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    FusedAdamBuilder,
    FusedLionBuilder,
)


def _banner() -> str:
    return (
        f"deepspeed {__version__} is zstack's compatibility package: DeepSpeed's API on "
        "zengine, zpartition, zoffload, zcomm and zpipe (not Microsoft's DeepSpeed; "
        "`pip uninstall deepspeed` gives the place back to it)"
    )


def op_report(verbose: bool = True) -> None:
    """DeepSpeed's op table: no op is built; each is available through what stands in for it."""
    del verbose
    rule = "-" * 78
    print(rule)
    print("DeepSpeed C++/CUDA extension op report (zstack)")
    print(rule)
    print("zstack builds no ops (no ninja, no JIT): each feature runs on torch's kernels or")
    print("zoffload's file I/O, so every op is compatible and none is installed.")
    print(rule)
    for builder in _BUILDERS:
        name = builder.NAME
        print(f"{name} {'.' * (22 - len(name))} [NO] ...... [OKAY]  {builder.INSTEAD}")
    print(rule)


def debug_report(hide_errors_and_warnings: bool = False) -> None:
    """DeepSpeed's general environment info: zengine's report."""
    print("DeepSpeed general environment info:")
    print(_banner())
    report = collect()
    print(
        format_report(
            report,
            color=sys.stdout.isatty(),
            warnings=not hide_errors_and_warnings,
            title="zstack",
        )
    )


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's ``ds_report`` flags."""
    parser = argparse.ArgumentParser(
        prog="ds_report",
        description="What is installed and which features this machine has (zstack's "
        "compatibility package).",
    )
    parser.add_argument(
        "--hide_operator_status",
        action="store_true",
        help="leave out DeepSpeed's op table (zstack builds no ops)",
    )
    parser.add_argument(
        "--hide_errors_and_warnings", action="store_true", help="leave out the warnings"
    )
    return parser.parse_args(argv)


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """Print the report (DeepSpeed's signature)."""
    if not hide_operator_status:
        op_report(verbose=not hide_errors_and_warnings)
    debug_report(hide_errors_and_warnings)


def cli_main(argv: Sequence[str] | None = None) -> None:
    """The ``ds_report`` command."""
    args = parse_arguments(argv)
    main(args.hide_operator_status, args.hide_errors_and_warnings)


if __name__ == "__main__":
    cli_main()
