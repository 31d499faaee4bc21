"""The ``zengine`` command: ``zengine consolidate CKPT OUT [--universal]`` (also ``python -m
zengine``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from zengine._checkpoint import DEFAULT_BUDGET, CheckpointError, consolidate, export_universal

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zengine", description="zengine checkpoint tools")
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint's model as one fp32 state dict",
        description="Write a sharded checkpoint's model as one fp32 state dict (torch.load-able, "
        "or safetensors when OUT ends in .safetensors), streaming: host memory stays near one "
        "batch of parameters.",
    )
    c.add_argument("checkpoint", help="a checkpoint directory, or the save_dir holding 'latest'")
    c.add_argument(
        "out", help="the output file (.safetensors for safetensors), or folder with --universal"
    )
    c.add_argument("--tag", default=None, help="the tag under CHECKPOINT (default: latest)")
    c.add_argument(
        "--universal",
        action="store_true",
        help="write DeepSpeed's universal checkpoint into the folder OUT instead, and "
        "'latest_universal' beside it naming it (as DeepSpeed's ds_to_universal does): DeepSpeed "
        'loads it at any world size and ZeRO stage with "checkpoint": {"load_universal": true}',
    )
    c.add_argument(
        "--budget-mib",
        type=int,
        default=DEFAULT_BUDGET >> 20,
        help="MiB of fp32 parameters read at a time (default: %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    budget = args.budget_mib << 20
    try:
        if args.universal:
            path = export_universal(
                args.checkpoint, args.out, tag=args.tag, latest=True, budget=budget
            )
        else:
            path = consolidate(args.checkpoint, args.out, tag=args.tag, budget=budget)
    except (CheckpointError, OSError) as error:
        print(f"zengine consolidate: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0
