"""The device of this rank (CUDA or CPU) and what the other packages ask of it.

DeepSpeed's ``get_accelerator()`` in small: device names, memory counters, streams and events
(no-ops on CPU), dtype support and the communication backend. Nothing here touches CUDA at
import time; the device is chosen on the first `get_accelerator()` call.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Accelerator", "CpuEvent", "CpuStream", "get_accelerator"]


class CpuStream:
    """A stand-in for a CUDA stream on CPU, where work is synchronous: every method is a no-op."""

    def synchronize(self) -> None:
        """Nothing to wait for on CPU."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to order on CPU."""

    def wait_event(self, event: Any) -> None:
        """Nothing to order on CPU."""

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        """Record (and return) an event at the current time."""
        event = event if event is not None else CpuEvent()
        event.record()
        return event

    def query(self) -> bool:
        """CPU work is always complete."""
        return True


class CpuEvent:
    """A stand-in for a CUDA event on CPU: records the wall-clock time, so timings still work."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        """Remember now."""
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Nothing to order on CPU."""

    def synchronize(self) -> None:
        """Nothing to wait for on CPU."""

    def query(self) -> bool:
        """CPU work is always complete."""
        return True

    def elapsed_time(self, end_event: CpuEvent) -> float:
        """Milliseconds between this event and `end_event`, like ``torch.cuda.Event``."""
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time: both events must have been recorded")
        return 1e3 * (end_event._time - self._time)


def _rss_bytes() -> int:
    # /proc gives the current resident size on Linux; elsewhere fall back to the peak.
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _max_rss_bytes()


def _max_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class Accelerator:
    """This rank's device: ``cuda`` (one GPU per rank, by LOCAL_RANK) or ``cpu``.

    On CPU the stream and event methods are no-ops and memory is the process's resident set
    (there is no allocator to ask), as DeepSpeed's CPU accelerator reports it.
    """

    def __init__(self, device_type: str) -> None:
        if device_type not in ("cuda", "cpu"):
            raise ValueError(
                f"Accelerator(device_type=...): expected 'cuda' or 'cpu', got {device_type!r}"
            )
        self._type = device_type  # fixed for the life of the process
        self._cuda = device_type == "cuda"

    def __repr__(self) -> str:
        return f"Accelerator({self._type!r})"

    # Devices.
    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``/``"cpu"``, or ``"cuda:1"`` with an index."""
        return self._type if device_index is None else f"{self._type}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        """A `torch.device` for this accelerator (the current device if no index)."""
        return torch.device(
            self.device_name(self.current_device() if device_index is None else device_index)
        )

    def current_device(self) -> int:
        """The index of the current device (0 on CPU)."""
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        """``"cuda:<current>"`` or ``"cpu"``."""
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def random(self) -> types.ModuleType:
        """``torch.random`` (DeepSpeed's accelerator gives its random module so)."""
        return torch.random

    def device_count(self) -> int:
        """The number of devices; on CPU, as DeepSpeed's CPU accelerator, one per local process
        (``LOCAL_SIZE``, else torchrun's ``LOCAL_WORLD_SIZE``, else 1)."""
        if self._cuda:
            return torch.cuda.device_count()
        local = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1"
        return max(1, int(local))

    def set_device(self, device_index: int) -> None:
        """Make `device_index` current (no-op on CPU)."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        """Whether the device can be used."""
        return torch.cuda.is_available() if self._cuda else True

    def is_synchronized_device(self) -> bool:
        """True on CPU, where no work is asynchronous."""
        return not self._cuda

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on this accelerator's device type."""
        return tensor.device.type == self._type

    def manual_seed(self, seed: int) -> None:
        """Seed the device's generator (the CPU one on CPU)."""
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator (the CPU one on CPU)."""
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """The seed the device's generator started from."""
        return int(torch.cuda.initial_seed() if self._cuda else torch.initial_seed())

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The device generator's state (the CPU one's on CPU), to `set_rng_state` later."""
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Put back a state `get_rng_state` gave."""
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        """The device's default generator (the CPU one on CPU)."""
        if self._cuda:
            return torch.cuda.default_generators[device_index]
        return torch.default_generator

    # Memory.
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes allocated by tensors on the device (resident set size on CPU)."""
        return torch.cuda.memory_allocated(device_index) if self._cuda else _rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of `memory_allocated` (peak resident set size on CPU, which cannot be reset)."""
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else _max_rss_bytes()

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes the caching allocator holds (`memory_allocated` on CPU, which has no cache)."""
        return torch.cuda.memory_reserved(device_index) if self._cuda else _rss_bytes()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of `memory_reserved` (peak resident set size on CPU)."""
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else _max_rss_bytes()

    def total_memory(self, device_index: int | None = None) -> int:
        """The device's memory in bytes (the machine's on CPU)."""
        if self._cuda:
            index = torch.cuda.current_device() if device_index is None else device_index
            return int(torch.cuda.get_device_properties(index).total_memory)
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes free on the device now (the machine's free memory on CPU)."""
        if self._cuda:
            return int(torch.cuda.mem_get_info(device_index)[0])
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart the peak counter (no-op on CPU)."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def empty_cache(self) -> None:
        """Give cached blocks back to the driver (no-op on CPU)."""
        if self._cuda:
            torch.cuda.empty_cache()

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all work on the device (no-op on CPU)."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of `tensor` for fast transfers; the tensor itself on CPU-only."""
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is in page-locked memory (False without CUDA)."""
        return bool(tensor.is_pinned()) if self._cuda else False

    # Streams and events.
    @property
    def Stream(self) -> type[Any]:
        """The stream class: ``torch.cuda.Stream`` or `CpuStream`."""
        return torch.cuda.Stream if self._cuda else CpuStream

    @property
    def Event(self) -> type[Any]:
        """The event class: ``torch.cuda.Event`` or `CpuEvent`."""
        return torch.cuda.Event if self._cuda else CpuEvent

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """A context manager that makes `stream` current (does nothing on CPU)."""
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        """The current stream (a `CpuStream` on CPU)."""
        return torch.cuda.current_stream(device_index) if self._cuda else CpuStream()

    def default_stream(self, device_index: int | None = None) -> Any:
        """The default stream (a `CpuStream` on CPU)."""
        return torch.cuda.default_stream(device_index) if self._cuda else CpuStream()

    # What the device computes and how it talks.
    def is_fp16_supported(self) -> bool:
        """Whether fp16 training is supported (not on CPU, where many kernels lack it)."""
        return self._cuda

    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating-point dtypes training runs in here."""
        found = [torch.float32]
        if self.is_fp16_supported():
            found.append(torch.float16)
        if self.is_bf16_supported():
            found.append(torch.bfloat16)
        return found

    def is_bf16_supported(self) -> bool:
        """Whether bf16 is supported (always on CPU; on CUDA, by the device)."""
        return bool(torch.cuda.is_bf16_supported()) if self._cuda else True

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device: ``nccl`` or ``gloo``."""
        return "nccl" if self._cuda else "gloo"

    def range_push(self, message: str) -> None:
        """Open an NVTX range (no-op on CPU)."""
        if self._cuda:
            torch.cuda.nvtx.range_push(message)  # type: ignore[no-untyped-call]

    def range_pop(self) -> None:
        """Close an NVTX range (no-op on CPU)."""
        if self._cuda:
            torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def range(self, message: str) -> Iterator[None]:
        """An NVTX range around a block (no-op on CPU)."""
        self.range_push(message)
        try:
            yield
        finally:
            self.range_pop()


_accelerator: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """This process's accelerator, chosen once: CUDA when available, else CPU.

    ``ZCOMM_ACCELERATOR=cpu`` (or ``cuda``) forces the choice, e.g. to test the CPU path on a
    GPU machine.
    """
    global _accelerator
    if _accelerator is None:
        forced = os.environ.get("ZCOMM_ACCELERATOR", "").strip().lower()
        if forced not in ("", "cpu", "cuda"):
            raise ValueError(f"ZCOMM_ACCELERATOR: expected 'cpu' or 'cuda', got {forced!r}")
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("ZCOMM_ACCELERATOR=cuda, but torch.cuda.is_available() is False")
        use_cuda = forced == "cuda" or (forced == "" and torch.cuda.is_available())
        _accelerator = Accelerator("cuda" if use_cuda else "cpu")
    return _accelerator
