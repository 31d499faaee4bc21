"""ZeRO-3 parameters for PyTorch: partitioning, hooks, prefetching, Init and GatheredParameters."""

from zpartition.__about__ import __version__

__all__ = ["__version__"]
