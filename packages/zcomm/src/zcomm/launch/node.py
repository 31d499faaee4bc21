"""``python -m zcomm.launch.node``: one node's ranks through one torchrun agent (DeepSpeed's
``deepspeed.launcher.launch`` arguments; see `zcomm.launch._node`)."""

import sys

from zcomm.launch._node import main, parse_args, select_node

__all__ = ["main", "parse_args", "select_node"]

if __name__ == "__main__":
    sys.exit(main())
