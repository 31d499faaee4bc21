"""``add_config_arguments``: DeepSpeed's command-line flags, which training scripts add to their
own parser and hand to ``initialize(args=...)``."""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed`` and ``--deepspeed_config`` (and DeepSpeed's hidden old spellings,
    ``--deepscale`` and ``--deepscale_config``) to `parser`, in a group of their own, and
    return it, as DeepSpeed's ``add_config_arguments``. ``initialize(args=parser.parse_args())``
    reads the config from ``args.deepspeed_config``."""
    group = parser.add_argument_group("DeepSpeed", "zengine's DeepSpeed-style configuration")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="train with zengine (accepted as DeepSpeed's flag; it changes nothing here)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config file"
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
