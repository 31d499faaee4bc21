"""initialize(), the ZeRO engine and optimizer, mixed precision, offload, pipeline engine and checkpoints."""

from zengine.__about__ import __version__

__all__ = ["__version__"]
