"""The safetensors file format, written one tensor at a time and read by byte ranges (no
package needed).

A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, and the tensors' bytes back to back. The header only needs
shapes and dtypes, so it is written first and the data streamed after it: memory holds one
tensor, not the model. Reading, `read_header` checks a header against the file's size and
`MappedFile` copies any range of a tensor's flattened elements out of the memory-mapped file.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from zengine._checkpoint._errors import CorruptCheckpointError

__all__ = ["Entry", "MappedFile", "SafetensorsWriter", "read_header", "read_safetensors"]

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
_DTYPES.update(  # read, never written by zengine
    F8_E4M3=torch.float8_e4m3fn,
    F8_E5M2=torch.float8_e5m2,
    U16=torch.uint16,
    U32=torch.uint32,
    U64=torch.uint64,
)
_MAX_HEADER = 100 << 20  # bytes; the safetensors package refuses larger headers too


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
        # a name of this process's: processes writing the same file (every rank converting a
        # checkpoint, as DeepSpeed's tests do) each replace it whole
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
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


# ---------------------------------------------------------------------------------------------
# Reading by byte ranges


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, from its header."""

    path: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # where its first byte lies, from the start of the file

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of the safetensors file `path`, by name, in the order of their bytes. A file
    that is not a whole safetensors file raises `CorruptCheckpointError` naming it."""
    size = path.stat().st_size
    if size < 8:
        raise CorruptCheckpointError(f"{path}: too short for a safetensors file ({size} bytes)")
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(size - 8, _MAX_HEADER):
            raise CorruptCheckpointError(
                f"{path}: a header of {length} bytes runs past the end of the file ({size} bytes)"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise CorruptCheckpointError(f"{path}: the header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: the header is not a JSON object")
    entries = [
        _entry(path, name, info, 8 + length, size)
        for name, info in header.items()
        if name != "__metadata__"
    ]
    return {e.name: e for e in sorted(entries, key=lambda e: e.offset)}


def _entry(path: Path, name: str, info: Any, data_start: int, size: int) -> Entry:
    try:
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(int(n) for n in info["shape"])
        begin, end = (int(n) for n in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} has no valid dtype, shape and data_offsets "
            f"({type(error).__name__}: {error})"
        ) from None
    entry = Entry(path, name, dtype, shape, data_start + begin)
    if min(shape, default=0) < 0 or begin < 0 or end - begin != entry.numel * dtype.itemsize:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} of shape {shape} and dtype {info['dtype']} does not "
            f"fit its data_offsets [{begin}, {end})"
        )
    if data_start + end > size:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} (bytes {data_start + begin} to {data_start + end}) runs "
            f"past the end of the file ({size} bytes): the file is cut short"
        )
    return entry


_PIECE_BYTES = 16 << 20
"""Bytes of the mapped file copied at a time, then dropped from this process's pages: the
resident part of the mapping stays this small however large a tensor or a rank's chunk is."""
_PAGE = mmap.PAGESIZE


class MappedFile:
    """A safetensors file mapped into memory, read a range of a tensor's elements at a time.

    [Note: why map and not the safetensors package]
    A ZeRO-3 rank owns a range of a parameter's *flattened* elements (``ds_tensor``), which
    begins and ends anywhere in a row. The safetensors package's ``get_slice`` takes slices by
    dimension, so such a range would have to be read as the whole rows it crosses (up to a
    whole row more at each end) and cut again. Over a mapping, the range is one
    ``torch.frombuffer(map, dtype=..., count=..., offset=...)`` tensor with no copy: exactly its
    pages are read from the file, then copied (and converted) into the shard, and dropped
    (``MADV_DONTNEED``) so they do not stay in this process's resident memory. The mapping is
    private (copy on write) only because ``frombuffer`` wants a writable buffer; it is never
    written, so no page is ever copied.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def copy_into(self, entry: Entry, start: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, start + out.numel())`` of `entry`, flattened, into the 1-D
        tensor `out` (converted to its dtype, as ``Tensor.copy_`` converts)."""
        itemsize = entry.dtype.itemsize
        per_piece = max(1, _PIECE_BYTES // itemsize)
        done, total = 0, out.numel()
        while done < total:
            count = min(per_piece, total - done)
            offset = entry.offset + (start + done) * itemsize
            self._advise("MADV_WILLNEED", offset, count * itemsize)  # read ahead all of it
            piece = torch.frombuffer(self.map, dtype=entry.dtype, count=count, offset=offset)
            out[done : done + count].copy_(piece)
            del piece
            self._advise("MADV_DONTNEED", offset, count * itemsize)
            done += count

    def _advise(self, option: str, offset: int, nbytes: int) -> None:
        advice = getattr(mmap, option, None)  # Linux has both; elsewhere the pages just stay
        if advice is not None:
            begin = offset // _PAGE * _PAGE
            self.map.madvise(advice, begin, offset + nbytes - begin)

    def close(self) -> None:
        # BufferError: a tensor over the map is still alive somewhere; it goes with that
        with contextlib.suppress(BufferError):
            self.map.close()
