"""initialize(), the ZeRO engine and optimizer, mixed precision, offload, pipelines, checkpoints."""

from zengine.__about__ import __version__

__all__ = ["__version__"]
