"""Training state to pinned host memory or NVMe and back, bit-exact, with a CuPy path on CUDA."""

from zoffload.__about__ import __version__

__all__ = ["__version__"]
