"""The safetensors file format, written one tensor at a time (no package needed).

A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, and the tensors' bytes back to back. The header only needs
shapes and dtypes, so it is written first and the data streamed after it: memory holds one
tensor, not the model.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["SafetensorsWriter", "read_safetensors"]

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    """Write a CPU tensor's bytes without copying them into a Python bytes object."""
    tensor = tensor.detach().contiguous()
    size = tensor.numel() * tensor.element_size()
    if size:
        f.write(memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())))


class SafetensorsWriter:
    """Write `entries` (name, dtype, shape), in that order, into `path` (atomically: a
    temporary file renamed when `close` is called)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        self.order: list[tuple[str, torch.dtype, torch.Size]] = []
        offset = 0
        for name, dtype, shape in entries:
            end = offset + _nbytes(dtype, shape)
            header[name] = {
                "dtype": _CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, end],
            }
            self.order.append((name, dtype, torch.Size(shape)))
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed by close()
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, dtype, shape = self.order[self.next]
        if name != expected or tensor.dtype != dtype or tensor.shape != shape:
            raise ValueError(
                f"{self.path}: expected {expected} {dtype} {tuple(shape)} next, got "
                f"{name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        write_tensor(self.file, tensor.cpu())
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            raise ValueError(f"{self.path}: {len(self.order) - self.next} tensors not written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (all in memory)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = bytearray(f.read())
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        flat = (
            torch.frombuffer(data[begin:end], dtype=dtype)
            if end > begin
            else torch.empty(0, dtype=dtype)
        )
        out[name] = flat.reshape(info["shape"]).clone()
    return out
