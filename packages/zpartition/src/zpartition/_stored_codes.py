"""A frozen unit's shard kept as int8 codes: ZeRO++'s MixZ++.

[Note: quantized frozen weights]
DeepSpeed's ``zero_quantized_nontrainable_weights`` (``ZeroParamConfig.
quantized_nontrainable_weights``): a unit none of whose parameters is trainable (LoRA's base
model) is quantized once, when the model is partitioned, into int8 codes with one float32 scale
per block of ``quantized_weights_block_size`` elements (a smaller shard: one block of its
size), and from then on the codes are what
the unit holds: about 1/4 of an fp32 shard's memory (1/2 of a bf16 one's), and every gather of
it, a pass's or an exact reader's, sends them as they are (`zcomm.all_gather_quantized` of a
`zcomm.Quantized`) and dequantizes them into the full buffer. The frozen weights *are* the
dequantized values from then on: each within half its block's scale of what was built (or
loaded) before partitioning, and the same on every rank and in every gather, so a unit so
gathered is exact ([Note: quantized weights]'s re-gather for exact readers does not apply).

The shard tensor (and so every ``ds_tensor`` view of it) stays the same object with its storage
resized to 0 bytes, as a `ShardStore` keeps an offloaded one; whoever reads or writes it brings
it in first (`fetch_shards`, ``Partitioned.fetch_shards``: the codes dequantized into it) and
lets it go after (`Unit.put_away`). A shard written while in (``ds_tensor.copy_``, a checkpoint
load) is quantized again as it goes, unless its values still equal what the codes hold: a
checkpoint of a quantized run loads back to the same codes. The codes take the place of a
`ShardStore`: with NVMe parameter offload they stay in host memory (a quarter of the bytes).

Which units: those with no trainable parameter whose parameters share one dtype the quantizer
reads (as [Note: quantized weights]); not the persistent unit (gathered always, small by the
persistence threshold), nor a unit on one rank, whose shard is its full data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

import zcomm
from zpartition._errors import ZeroParamError

__all__ = ["StoredCodes", "joined", "quantization_block"]


def quantization_block(block_size: int, numel: int) -> int:
    """The block size `numel` elements are quantized in: `block_size`, or one block of them
    all when they are fewer, so that nothing is padded to a whole block."""
    return max(1, min(block_size, numel))


class StoredCodes:
    """A unit's shard (`shard`'s bytes viewed as `dtype`) as int8 codes, padded to whole
    blocks; the shard's storage is freed while it is away."""

    __slots__ = ("codes", "version")

    def __init__(self, shard: torch.Tensor, dtype: torch.dtype, block_size: int, name: str) -> None:
        # a shard smaller than a block is one block of its own size (units of one size, a
        # model's repeated layers, still go in one gather)
        block = quantization_block(block_size, shard.numel() // dtype.itemsize)
        self.codes = _encode(shard, dtype, block, name)
        self.version = shard._version  # the shard's version the codes hold

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes

    def bring_in(self, shard: torch.Tensor) -> None:
        """The codes' values into `shard` (a no-op while it is in)."""
        storage = shard.untyped_storage()
        if storage.nbytes() == shard.numel():
            return
        storage.resize_(shard.numel())
        values = shard.view(self.dtype)
        values.copy_(self._decoded(values.numel()))
        self.version = shard._version

    def put_away(self, shard: torch.Tensor, name: str) -> None:
        """Free `shard`'s memory, quantizing it again first if it was written to other
        values than the codes'."""
        storage = shard.untyped_storage()
        if storage.nbytes() == 0:
            return
        if shard._version != self.version:
            values = shard.view(self.dtype)
            if not torch.equal(values, self._decoded(values.numel())):
                self.codes = _encode(shard, self.dtype, self.codes.block_size, name)
        storage.resize_(0)

    def _decoded(self, numel: int) -> torch.Tensor:
        return zcomm.dequantize(self.codes)[:numel]


def _encode(shard: torch.Tensor, dtype: torch.dtype, block: int, name: str) -> zcomm.Quantized:
    """`shard`'s bytes viewed as `dtype`, quantized in blocks of `block` elements, padded to
    whole blocks: units' codes go side by side."""
    values = shard.view(dtype)
    try:
        q = zcomm.quantize(
            torch.nn.functional.pad(values, (0, -values.numel() % block)), bits=8, block_size=block
        )
    except zcomm.QuantizationError as error:
        raise ZeroParamError(
            f"quantized_nontrainable_weights: the frozen parameters of {name!r} cannot be "
            f"stored quantized: {error}"
        ) from None
    if shard.is_pinned():  # pinned host shards copy to the device asynchronously
        q = dataclasses.replace(q, data=q.data.pin_memory(), scales=q.scales.pin_memory())
    return q


def joined(stored: Sequence[StoredCodes], device: torch.device) -> zcomm.Quantized:
    """Several units' codes (of one dtype and block size) as one, on `device`: one gather."""
    first = stored[0].codes
    if len(stored) == 1 and first.data.device == device:
        return first  # read, never written: no copy
    parts = [s.codes for s in stored]
    data, scales = (
        torch.cat([t.to(device, non_blocking=True) for t in tensors])
        for tensors in ([q.data for q in parts], [q.scales for q in parts])
    )
    numel = sum(q.numel for q in parts)
    return zcomm.Quantized(data, scales, numel, 8, first.block_size, first.dtype)
