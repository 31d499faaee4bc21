"""Reading torch.distributed.checkpoint's files without running code from them.

DCP's own reader unpickles ``.metadata`` with ``pickle.load`` and every non-tensor entry of a
``.distcp`` file (the client state, the RNG state, the optimizer's groups) with
``torch.load(weights_only=False)``: a checkpoint from someone else runs whatever callable its
pickles name. Here ``.metadata`` is read by an unpickler that finds only DCP's own metadata
classes and the torch types they hold, and every entry by ``torch.load(weights_only=True)``
(tensors, numbers, strings, containers, and NumPy's arrays: the RNG state holds one). A file that
asks for anything else is refused with `UnsafeCheckpointError` naming the file and the type;
nothing it names is called.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import filesystem, metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.futures import Future

from zengine._checkpoint._errors import CheckpointError, CorruptCheckpointError
from zengine._checkpoint._safe_load import refused, unpickling_error

__all__ = ["SafeFileSystemReader", "load_entries", "load_object"]

# What DCP's .metadata pickles name: its dataclasses, the enum of memory formats, torch's Size
# and layout decoder, and the path the checkpoint was saved to.
_METADATA_CLASSES: dict[tuple[str, str], Any] = {
    (cls.__module__, cls.__qualname__): cls
    for cls in (
        metadata.Metadata,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        torch.Size,
        OrderedDict,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
    )
}
_METADATA_CLASSES["torch.serialization", "_get_layout"] = torch.serialization._get_layout
_METADATA_CLASSES["pathlib._local", "PosixPath"] = pathlib.PosixPath  # Python 3.13's module
_METADATA_CLASSES["pathlib._local", "WindowsPath"] = pathlib.WindowsPath


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes and torch's dtypes, layouts and memory formats; nothing else."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_CLASSES.get((module, name))
        if found is not None:
            return found
        if module == "torch":  # a dtype, layout or memory format pickles as its name in torch
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise refused(self.path, f"{module}.{name}")


def _numpy_globals() -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """NumPy's array and its rebuilding function under both their module names (the RNG state
    holds NumPy's generator state); none without NumPy."""
    try:  # Any: NumPy is optional here (torch runs without it), and so are its types
        numpy: Any = importlib.import_module("numpy")
    except ImportError:
        return []
    core = getattr(numpy, "_core", None) or numpy.core
    reconstruct = core.multiarray._reconstruct
    found: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [numpy.ndarray, numpy.dtype]
    found += [
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        (reconstruct, "numpy.core.multiarray._reconstruct"),
    ]
    found += [
        (cls, f"numpy.dtypes.{cls.__name__}")
        for cls in vars(getattr(numpy, "dtypes", object)).values()
        if isinstance(cls, type) and issubclass(cls, numpy.dtype)
    ]
    return found


_OBJECT_GLOBALS = _numpy_globals()


def load_object(data: IO[bytes]) -> Any:
    """One non-tensor DCP entry, loaded with ``weights_only=True`` (and NumPy's arrays)."""
    with torch.serialization.safe_globals(_OBJECT_GLOBALS):
        return torch.load(data, map_location="cpu", weights_only=True)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with `_MetadataUnpickler` and refusing, by file
    and type, a ``.distcp`` entry that asks for an object (with `load_object` as the planner's
    ``load_bytes``, see `PieceLoadPlanner`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> metadata.Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as f:
                loaded = _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path} is missing") from None
        except Exception as error:  # a damaged pickle fails in any of many ways
            raise CorruptCheckpointError(
                f"{path} cannot be read: {type(error).__name__}: {error}"
            ) from None
        if not isinstance(loaded, metadata.Metadata):
            raise CorruptCheckpointError(
                f"{path} holds a {type(loaded).__name__}, not DCP's Metadata"
            )
        meta = getattr(loaded, "storage_meta", None) or metadata.StorageMeta()
        meta.load_id = self.load_id
        loaded.storage_meta = meta
        return loaded

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except pickle.UnpicklingError as error:  # weights_only refused what it asked for
                raise unpickling_error(Path(self.path) / relative, error) from None
        future: Future[None] = Future()
        future.set_result(None)
        return future


def load_entries(dest: dict[str, Any], directory: Path, planner: LoadPlanner) -> None:
    """DCP's load of `dest` from `directory` in this process alone (no collective), through
    `SafeFileSystemReader`; a failure is a `CheckpointError`: the reader's own (a refused
    object: `UnsafeCheckpointError`), or `CorruptCheckpointError` with DCP's message."""
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(
                dest, storage_reader=SafeFileSystemReader(directory), planner=planner, no_dist=True
            )
    except CheckpointException as exc:
        failures = [e for e, _ in exc.failures.values()]
        ours = [e for e in failures if isinstance(e, CheckpointError)]
        if ours:
            raise ours[0] from None
        detail = "; ".join(f"{type(e).__name__}: {e}" for e in failures)
        raise CorruptCheckpointError(f"{directory}: reading failed: {detail}") from None
