"""``deepspeed.launcher.launch``: DeepSpeed's per-node launcher (``--world_info``,
``--node_rank``, ``--master_addr``, ``--master_port``, ...), on zcomm's: one torchrun agent
for this node's slots (`zcomm.launch.node`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from zcomm.launch import node as _node

__all__ = ["main"]


def main(args: Sequence[str] | None = None) -> None:
    """Start this node's ranks; exits with the failed rank's status."""
    code = _node.main(args)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
