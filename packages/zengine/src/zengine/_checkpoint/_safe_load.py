"""Reading torch.save files without running code from them.

A torch.save file is a pickle: loading one with ``weights_only=False`` (what DeepSpeed's
checkpoint engine and its ``zero_to_fp32.py`` do) runs whatever callable the file names. Files
are read here with ``weights_only=True``: tensors, containers and numbers only, plus the few
classes a caller names, each mapped to a stand-in of ours that holds the pickled attributes and
runs nothing. A file that asks for anything else is refused with `UnsafeCheckpointError`, naming
the file and the type it asked for.
"""

from __future__ import annotations

import ctypes
import mmap as mmap_module
import pickle
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from zengine._checkpoint._errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["Attributes", "load_file", "mappable", "refused", "release", "unpickling_error"]


class Attributes:
    """What an object of an allowed class held (its pickled ``__dict__``), as plain attributes;
    `kind` names the class the file asked for. Nothing of that class runs."""

    kind = "object"

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"{self.kind}({self.__dict__})"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def stand_in(full_name: str) -> type[Attributes]:
    """A fresh `Attributes` class standing for the class `full_name` ("module.Class")."""
    return type(full_name.rpartition(".")[2], (Attributes,), {"kind": full_name})


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_file(
    path: Path, allowed: Mapping[str, Callable[..., Any]] | None = None, *, mmap: bool = False
) -> Any:
    """`path`'s object, loaded on the CPU without running code; `allowed` maps a class or
    function name the file may use ("module.Name") to what stands for it (an `Attributes`
    class, or a function of the pickled arguments). With `mmap` the tensors' storages are
    mapped, not read: only what is used is paged in (zip-format files; others are read)."""
    globals_: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
        (fn, name) for name, fn in (allowed or {}).items()
    ]
    use_mmap = mmap and mappable(path)
    try:
        with torch.serialization.safe_globals(globals_):
            loaded: Any = torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)
            return loaded
    except pickle.UnpicklingError as error:
        raise unpickling_error(path, error) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as error:
        raise CorruptCheckpointError(f"{path} cannot be read: {error}") from None


def unpickling_error(path: Path, error: pickle.UnpicklingError) -> CorruptCheckpointError:
    """What a ``weights_only`` load's error means: `refused` for the global it names, else a
    damaged file."""
    match = _GLOBAL.search(str(error))
    if match:
        return refused(path, match.group(1))
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return CorruptCheckpointError(f"{path} cannot be read: {first}")


def refused(path: Path, asked: str) -> UnsafeCheckpointError:
    """The error for a file `path` that asks for `asked` ("module.Name")."""
    return UnsafeCheckpointError(
        f"{path} asks for {asked}, which zstack does not load: a checkpoint may hold "
        "tensors, numbers, strings and containers of them (and the DeepSpeed records zstack "
        "reads), never other objects, since unpickling one can run code. Save such values "
        "elsewhere, or load this file yourself with torch.load(weights_only=False) if you "
        "trust where it came from."
    )


def mappable(path: Path) -> bool:
    """Whether ``load_file(path, mmap=True)`` maps `path`'s storages (a zip-format file)."""
    return zipfile.is_zipfile(path)


_PAGE = mmap_module.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True) if hasattr(mmap_module, "MADV_DONTNEED") else None


def release(tensor: torch.Tensor) -> None:
    """Give back the pages of a read-only view of a *mapped* file (``load_file(...,
    mmap=True)``) once it has been read: the kernel drops them from this process (a later read
    maps them again from the file), so reading a file that way costs a rank about one
    parameter's bytes of memory, not the file's. Never call it on other memory: anonymous pages
    given back read as zeros. A no-op where madvise is not available."""
    if _libc is None or not tensor.numel():
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // _PAGE) * _PAGE  # whole pages inside the view only
    last = end // _PAGE * _PAGE
    if last > first:
        _libc.madvise(
            ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap_module.MADV_DONTNEED
        )
