"""DeepSpeed's ``tests/utils.py``: `setup_serial_env` (zcomm's)."""

from zcomm.testing import setup_serial_env

__all__ = ["setup_serial_env"]
