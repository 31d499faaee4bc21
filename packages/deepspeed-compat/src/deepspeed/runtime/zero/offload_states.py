"""``deepspeed.runtime.zero.offload_states``: `get_state_devices` (zengine's)."""

from zengine import get_state_devices

__all__ = ["get_state_devices"]
