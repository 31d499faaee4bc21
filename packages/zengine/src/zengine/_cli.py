"""The ``zengine`` command (also ``python -m zengine``):

- ``zengine consolidate CKPT OUT [--universal]``: a sharded checkpoint as one state dict;
- ``zengine launch [DeepSpeed's launcher arguments] SCRIPT ARGS``: the ranks started through
  torchrun on each node (`zcomm.launch`, what the compatibility package's ``deepspeed``
  command runs);
- ``zengine report [--json] [--nvme-path DIR]``: what is installed and which features this
  machine has (what the compatibility package's ``ds_report`` prints).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from zcomm import launch
from zengine._checkpoint import DEFAULT_BUDGET, CheckpointError, consolidate, export_universal
from zengine.report import collect, format_report

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zengine", description="zengine: checkpoint tools, the launcher, the report"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    # `launch` hands everything after it to the launcher's own parser (see main); listed here
    # for --help
    commands.add_parser(
        "launch",
        add_help=False,
        help="start a script's ranks through torchrun on each node (DeepSpeed's launcher "
        "arguments: --num_gpus, --hostfile, --include, --launcher, ...; zengine launch --help)",
    )
    r = commands.add_parser(
        "report",
        help="what is installed and which features this machine has",
        description="What is installed (zstack's packages, torch, the Hugging Face libraries, "
        "which 'deepspeed') and which features this machine has, each with the reason.",
    )
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.add_argument(
        "--nvme-path", default=None, help="the folder to try O_DIRECT in (default: temp dir)"
    )
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
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        return launch.main(argv[1:], prog="zengine launch")
    args = _parser().parse_args(argv)
    if args.command == "report":
        report = collect(args.nvme_path)
        if args.json:
            print(json.dumps(report.to_dict(), indent=1))
        else:
            print(format_report(report, color=sys.stdout.isatty()))
        return 0
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
