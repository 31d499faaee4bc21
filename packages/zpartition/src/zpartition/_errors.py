"""The one error zpartition raises for misuse it detects at run time."""

from __future__ import annotations

__all__ = ["ZeroParamError"]


class ZeroParamError(RuntimeError):
    """A partitioned parameter was used wrongly, or ranks disagree on which parameters to gather.

    The message names the parameter, the module and the rank.
    """
