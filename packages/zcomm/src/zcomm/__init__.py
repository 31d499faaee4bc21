"""torch.distributed underneath zstack: process groups, collectives, p2p, topology, accelerator and the distributed test harness."""

from zcomm.__about__ import __version__

__all__ = ["__version__"]
