"""How torch.distributed.checkpoint (DCP) stores a rank's piece of a parameter.

[Note: checkpoints keyed by parameter name]
Every tensor a checkpoint holds is a whole parameter's (or its optimizer state's) *flattened*
data, keyed by the parameter's name; a rank writes only the piece it owns, ``[offset, offset +
numel)`` of that 1-D tensor, as DCP chunk metadata. A ZeRO-3 shard is ``[r*c, (r+1)*c)`` clipped
to the parameter's size (c = ceil(n / W), the padding is never written); a stage 1-2 partition
may start and end anywhere inside a parameter; stage 0 holds every piece whole on every rank
(DCP keeps one copy). Nothing in the files depends on the world size or the stage, so DCP
reshards on load (each rank reads the byte ranges that overlap its pieces) and an offline
reader can rebuild any parameter from the chunks alone.

`Piece` is the state-dict value for such a piece; the two planners teach DCP's default
planners about it. Every other value (a full tensor, a Python object) takes DCP's default path.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)

from zengine._checkpoint._dcp_read import load_object

__all__ = ["Piece", "PieceLoadPlanner", "PieceSavePlanner"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """`data` (1-D) is elements ``[offset, offset + data.numel())`` of a flattened tensor of
    `size` elements. On save it is read; on load it is written in place."""

    data: torch.Tensor
    offset: int
    size: int

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(
            offsets=torch.Size([self.offset]), sizes=torch.Size([self.data.numel()])
        )


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus `Piece` values (one chunk each)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for key, value in self.state_dict.items():
            if isinstance(value, Piece):
                if value.data.numel():
                    items.append(_write_item(key, value))
            else:
                items.extend(_create_write_items(key, value))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        if isinstance(value, Piece):
            return _own_storage(value.data)
        if isinstance(value, torch.Tensor):
            return _own_storage(value)
        return value


_SLACK = 4096  # bytes of a storage beyond its view worth writing rather than copying


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the host, copied when it is a view of a larger storage: torch.save writes
    a view's whole storage (a stage 1-2 piece lies in a flat buffer of all the parameters). A
    ZeRO-3 shard is written as it is (its storage is the shard, plus at most W-1 padding)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu")
    if tensor.untyped_storage().nbytes() > tensor.nbytes + _SLACK or not tensor.is_contiguous():
        return tensor.clone()
    return tensor


def _write_item(key: str, piece: Piece) -> WriteItem:
    chunk = piece.chunk()
    return WriteItem(
        index=MetadataIndex(key, chunk.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=chunk,
            properties=TensorProperties.create_from_tensor(piece.data),
            size=torch.Size([piece.size]),
        ),
    )


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus `Piece` destinations: each reads the stored chunks that
    overlap it, whatever pieces wrote them (resharding)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # Not the default's: its state-dict walk turns values of unknown types (a Piece) to None.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for key, value in self.state_dict.items():
            if isinstance(value, Piece) and value.size == 0:
                continue  # a tensor without elements: nothing was written, nothing to read
            stored = self.metadata.state_dict_metadata.get(key)
            if stored is None:
                raise KeyError(f"the checkpoint has no entry {key!r}")
            if not isinstance(value, Piece):
                items.extend(_create_read_items(key, stored, value))
                continue
            if not isinstance(stored, TensorStorageMetadata) or tuple(stored.size) != (value.size,):
                shape = tuple(stored.size) if isinstance(stored, TensorStorageMetadata) else "bytes"
                raise ValueError(
                    f"checkpoint entry {key!r} holds {shape}, expected a tensor of "
                    f"{value.size} elements"
                )
            if value.data.numel():
                items.extend(create_read_items_for_chunk_list(key, stored, [value.chunk()]))
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # not the default's torch.load(weights_only=False), which runs what the entry names
        self.state_dict[read_item.dest_index.fqn] = load_object(value)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        return value.data if isinstance(value, Piece) else value
