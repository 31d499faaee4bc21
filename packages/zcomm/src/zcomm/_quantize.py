"""Block-wise int8 and int4 quantization, so that ZeRO++-style collectives can move a quarter
or an eighth of the bytes of fp32 (half or a quarter of those of bf16).

A tensor is flattened and cut into blocks of ``block_size`` elements, the last one padded with
zeros; each block keeps one float32 scale, ``absmax / qmax`` (one float larger where ``qmax *
scale`` falls short of absmax), and its elements become integers in ``[-qmax, qmax]`` (qmax 127
for 8 bits, 7 for 4 bits; symmetric, so zero is exact and no zero point travels). Everything is
plain vectorised torch, the same code on CPU and CUDA, and computes in float32 whatever the
input's dtype.

Error bound, per element x of a block of scale s (up to float32 rounding of ``x / s`` and
``q * s``, a few units in the last place of x; a bf16 or fp16 result adds its own rounding):

- round to nearest (the default): ``|x - dequantize(quantize(x))| <= s / 2``;
- stochastic rounding: ``|x - dequantize(quantize(x))| < s``, and the expected result is x.

A block of zeros has scale 0 and comes back as exact zeros, as does every zero element. An
element equal to its block's absmax (either sign) comes back exactly from bf16 and fp16 inputs;
from float32 it does when ``qmax * scale`` rounds back to absmax (about 99.6% of values at
8 bits, 95% at 4 bits), else it is one unit in the last place off: no float32 scale multiplies
back to those values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zcomm._errors import CommError, _global_rank

__all__ = ["QuantizationError", "Quantized", "dequantize", "quantize", "quantized_nbytes"]

# The largest code of each width: symmetric ranges, so -qmax..qmax (int8's -128 and int4's -8
# are never used, which keeps the negation of a block exact).
_QMAX = {8: 127, 4: 7}
# int4 codes travel as q + 8 (1..15) in a nibble: no sign extension when unpacking.
_INT4_OFFSET = 8


class QuantizationError(CommError):
    """`quantize` was given a tensor with NaN or inf in it: no finite scale can represent it.

    ``count`` is the number of non-finite elements and ``index`` the flat index of the first.
    """

    def __init__(self, count: int, numel: int, index: int, shape: tuple[int, ...]) -> None:
        self.count = count
        self.index = index
        where = f"flat index {index}"
        if len(shape) > 1:
            where += f" (index {_unravel(index, shape)} of shape {shape})"
        super().__init__(
            "quantize",
            "this rank's tensor",
            _global_rank(),
            f"{count} of {numel} elements are not finite (NaN or inf), the first at {where}",
        )


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    place = []
    for size in reversed(shape):
        index, rest = divmod(index, size)
        place.append(rest)
    return tuple(reversed(place))


def _check_format(bits: int, block_size: int) -> int:
    """qmax for `bits`, after checking both arguments; ValueError naming the bad one."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in _QMAX:
        raise ValueError(f"bits: expected 4 or 8, got {bits!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if bits == 4 and block_size % 2:
        # Two codes share a byte; an odd block would split a byte between two blocks.
        raise ValueError(f"block_size: must be even for bits=4, got {block_size}")
    return _QMAX[bits]


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def quantized_nbytes(numel: int, *, bits: int, block_size: int) -> int:
    """The bytes `quantize` puts on the wire for `numel` elements: the packed codes of every
    block (the last one padded) and 4 bytes of float32 scale per block; equals
    ``quantize(x, bits=bits, block_size=block_size).nbytes`` for any x of `numel` elements."""
    _check_format(bits, block_size)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel: expected a non-negative int, got {numel!r}")
    blocks = _blocks(numel, block_size)
    return blocks * (block_size * bits // 8 + 4)


@dataclass(frozen=True)
class Quantized:
    """A quantized tensor, as it travels: `data` holds the codes of `numel` elements in blocks
    of `block_size` (the last padded with zeros) and `scales` one float32 scale per block.

    For 8 bits `data` is int8, one code per element. For 4 bits it is uint8 with two codes per
    byte: element 2i in the low nibble, 2i + 1 in the high one, each stored as code + 8.
    `dtype` is the dtype `dequantize` gives back.
    """

    data: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        # A Quantized may be rebuilt from gathered buffers: say which field does not fit
        # rather than fail with a shape error inside dequantize.
        _check_format(self.bits, self.block_size)
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 0:
            raise ValueError(
                f"Quantized(numel=...): expected a non-negative int, got {self.numel!r}"
            )
        blocks = _blocks(self.numel, self.block_size)
        want = torch.int8 if self.bits == 8 else torch.uint8
        length = blocks * self.block_size * self.bits // 8
        if self.data.dtype != want or self.data.shape != (length,):
            raise ValueError(
                f"Quantized(data=...): expected a flat {want} tensor of {length} elements for "
                f"{self.numel} elements in blocks of {self.block_size} at {self.bits} bits, got "
                f"{self.data.dtype} of shape {tuple(self.data.shape)}"
            )
        if self.scales.dtype != torch.float32 or self.scales.shape != (blocks,):
            raise ValueError(
                f"Quantized(scales=...): expected a flat torch.float32 tensor of {blocks} "
                f"elements, got {self.scales.dtype} of shape {tuple(self.scales.shape)}"
            )
        if not self.dtype.is_floating_point:
            raise ValueError(f"Quantized(dtype=...): expected a floating dtype, got {self.dtype}")

    @property
    def nbytes(self) -> int:
        """The bytes on the wire: codes and scales (equals `quantized_nbytes`)."""
        return (
            self.data.numel() * self.data.element_size()
            + self.scales.numel() * self.scales.element_size()
        )


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 8,
    block_size: int = 2048,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> Quantized:
    """Quantize `x` (any shape, a floating dtype) to `bits` bits in blocks of `block_size`
    elements of its flattened form; see the module docstring for the error bound. The work is
    in float32: a float64 `x` is rounded to float32 first.

    `stochastic=True` rounds each scaled value up with probability equal to its fractional
    part, so that the result is unbiased (for gradients); `generator`, on x's device, makes it
    repeatable. NaN or inf anywhere in `x` raises `QuantizationError`.
    """
    qmax = _check_format(bits, block_size)
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    numel = x.numel()
    blocks = _blocks(numel, block_size)
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = blocks * block_size - numel
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    values = flat.view(blocks, block_size)

    absmax = values.abs().amax(dim=1)
    # amax propagates NaN and inf, so checking the per-block maxima finds any non-finite
    # element at a fraction of the cost of a full pass; this is one device sync per call.
    if not bool(torch.isfinite(absmax).all()):
        bad = ~torch.isfinite(x.detach().reshape(-1))
        first = int(bad.to(torch.uint8).argmax())  # argmax gives the first of equal maxima
        raise QuantizationError(int(bad.sum()), numel, first, tuple(x.shape))
    scales = absmax / qmax
    # Below about 1e-36 the scale is subnormal and may round far down (to 0 below about 1e-43),
    # which would push codes past qmax and break the error bound; step a scale that falls short
    # up by one float, so that absmax / scale <= qmax holds and only zeros have scale 0.
    too_small = scales * qmax < absmax
    scales = torch.where(too_small, torch.nextafter(scales, absmax), scales)
    # A zero scale means a block of zeros: divide by 1 instead, the codes are 0 either way.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = values / divisor.unsqueeze(1)
    if stochastic:
        # floor + (u < fraction) rather than floor(scaled + u): the float sum can round up to
        # the next integer, and an integer would then sometimes move by a whole step.
        codes = torch.floor(scaled)
        fraction = scaled.sub_(codes)
        noise = torch.rand(
            fraction.shape, generator=generator, device=fraction.device, dtype=torch.float32
        )
        codes.add_(noise < fraction)
    else:
        codes = torch.round(scaled)
    # absmax / scale can round to a hair above qmax (and stochastic rounding can then step
    # past it): clamp, which only ever moves a code to qmax, never further from x.
    codes = codes.clamp_(-qmax, qmax).reshape(-1)

    if bits == 8:
        data = codes.to(torch.int8)
    else:
        nibbles = codes.add_(_INT4_OFFSET).to(torch.uint8).view(-1, 2)
        data = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return Quantized(data, scales, numel, bits, block_size, x.dtype)


def dequantize(q: Quantized, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The flat tensor of ``q.numel`` elements and dtype ``q.dtype`` that `q` stands for,
    written into `out` (flat, ``q.numel`` elements of ``q.dtype`` on q's device) if given."""
    if out is not None and (
        out.shape != (q.numel,) or out.dtype != q.dtype or out.device != q.data.device
    ):
        raise ValueError(
            f"out: expected a flat {q.dtype} tensor of {q.numel} elements on {q.data.device}, "
            f"got {out.dtype} of shape {tuple(out.shape)} on {out.device}"
        )
    if q.bits == 8:
        codes = q.data.to(torch.float32)
    else:
        nibbles = torch.stack((q.data & 0x0F, q.data >> 4), dim=1)
        codes = nibbles.to(torch.float32).sub_(_INT4_OFFSET)
    values = codes.view(-1, q.block_size).mul_(q.scales.unsqueeze(1)).view(-1)[: q.numel]
    if out is None:
        return values.to(q.dtype)
    return out.copy_(values)
