"""Block-wise quantization: the error bound per element, exact zeros and extremes, int4 packing,
unbiased and repeatable stochastic rounding, the wire bytes, and the errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zcomm
from zcomm import QuantizationError, Quantized, dequantize, quantize, quantized_nbytes

_QMAX = {8: 127, 4: 7}
# float32 rounding of x / s and of q * s: about 2 units of 2**-24 relative to x, doubled.
_F32_SLACK = 2.0**-22
# The smallest float32 (and bf16) subnormal: rounding of q * s where it is subnormal.
_TINY = 2.0**-149


def _per_element(q: Quantized) -> torch.Tensor:
    """Each element's block scale."""
    return q.scales.repeat_interleave(q.block_size)[: q.numel]


def _one_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x.abs(), torch.tensor(float("inf"))) - x.abs()


@settings(max_examples=50, deadline=None)
@given(
    numel=st.integers(0, 3000),
    half_block=st.integers(1, 300),
    bits=st.sampled_from([4, 8]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    stochastic=st.booleans(),
    exponent=st.integers(-140, 100),
    zeros=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_error_bound_per_element(
    numel, half_block, bits, dtype, stochastic, exponent, zeros, seed
) -> None:
    g = torch.Generator().manual_seed(seed)
    block_size = 2 * half_block if bits == 4 else 2 * half_block - 1  # odd sizes too at 8 bits
    x = torch.randn(numel, generator=g) * 2.0**exponent
    x[torch.rand(numel, generator=g) < zeros] = 0.0
    x = x.to(dtype)
    q = quantize(x, bits=bits, block_size=block_size, stochastic=stochastic, generator=g)
    y = dequantize(q)
    assert y.shape == (numel,)
    assert y.dtype == dtype
    # The bound is on the float32 values: for bf16 the reference is the float32 value of the
    # bf16 input (exact), and the bf16 output adds its rounding of the result, at most 2**-8
    # relative (bf16 has 8 significant bits) or half its smallest subnormal spacing, 2**-134.
    ref, out, scale = x.float(), y.float(), _per_element(q)
    bound = (1.0 if stochastic else 0.5) * scale
    tol = bound + _F32_SLACK * ref.abs() + _TINY
    if dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * out.abs() + 2.0**-134
    err = (ref - out).abs()
    assert bool((err <= tol).all()), f"worst excess {(err - tol).max().item()}"
    assert bool((out[ref == 0] == 0).all())  # zeros stay exact zeros
    # a scale is 0 exactly when its block is all zeros
    padded = torch.nn.functional.pad(ref, (0, q.scales.numel() * block_size - numel))
    assert torch.equal(q.scales == 0, padded.view(-1, block_size).abs().amax(dim=1) == 0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
def test_zeros_are_exact(bits, stochastic) -> None:
    x = torch.zeros(5000)
    q = quantize(x, bits=bits, block_size=1024, stochastic=stochastic)
    assert q.scales.tolist() == [0.0] * 5
    assert torch.equal(dequantize(q), x)
    # zeros inside a block with non-zero neighbours
    x = torch.tensor([0.0, 1.5, 0.0, -0.3, 0.0, 0.0, 7.25, 0.0])
    y = dequantize(quantize(x, bits=bits, block_size=4, stochastic=stochastic))
    assert (y[x == 0] == 0).all()
    assert (y[x != 0] != 0).any()


@pytest.mark.parametrize("bits", [4, 8])
def test_absmax_comes_back(bits) -> None:
    qmax = _QMAX[bits]
    # Blocks of two: the first element is the block's absmax (either sign), the second smaller.
    g = torch.Generator().manual_seed(0)
    top = (torch.rand(20000, generator=g) + 1) * torch.exp2(torch.randint(-40, 40, (20000,)))
    top = torch.where(torch.rand(20000, generator=g) < 0.5, top, -top)
    x = torch.stack((top, top / 3), dim=1).reshape(-1)
    # bf16 (and fp16) inputs: always exact
    xb = x.to(torch.bfloat16)
    yb = dequantize(quantize(xb, bits=bits, block_size=2))
    assert torch.equal(yb[0::2], xb[0::2])
    # float32: exact whenever qmax * scale rounds back to absmax, else one unit in the last place
    q = quantize(x, bits=bits, block_size=2)
    y = dequantize(q)[0::2]
    representable = q.scales * qmax == top.abs()
    assert representable.float().mean() > (0.99 if bits == 8 else 0.9)
    assert torch.equal(y[representable], top[representable])
    assert ((y - top).abs() <= _one_ulp(top)).all()
    # round numbers and powers of two are among the exact ones
    x = torch.tensor([1.0, -0.25, 3.0, -1.0, -(2.0**-20), 2.0**-22, 2.0**30, 1.0])
    assert torch.equal(dequantize(quantize(x, bits=bits, block_size=2))[0::2], x[0::2])


def test_int4_packing_round_trips_every_pair() -> None:
    codes = torch.arange(-7, 8, dtype=torch.float32)
    pairs = torch.cartesian_prod(codes, codes)  # (225, 2): every low and high nibble
    x = pairs.reshape(-1)
    q = quantize(x, bits=4, block_size=x.numel())  # one block of absmax 7: scale 1
    assert q.scales.tolist() == [1.0]
    assert q.data.dtype == torch.uint8
    assert q.data.shape == (225,)
    expected = (pairs[:, 0] + 8).to(torch.uint8) | ((pairs[:, 1] + 8).to(torch.uint8) << 4)
    assert torch.equal(q.data, expected)  # element 2i low nibble, 2i + 1 high, code + 8
    assert torch.equal(dequantize(q), x)


def test_int8_codes_are_symmetric() -> None:
    x = torch.linspace(-1, 1, 1001)
    q = quantize(x, bits=8, block_size=1001)
    assert q.data.dtype == torch.int8
    assert q.data.min().item() == -127
    assert q.data.max().item() == 127
    assert torch.equal(q.data, -q.data.flip(0))


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_is_unbiased(bits) -> None:
    # 128 fixed values in 2 blocks, repeated 4096 times with the same block alignment, so that
    # every copy has the same scales: one call gives 4096 independent roundings of each value.
    g = torch.Generator().manual_seed(1)
    base = torch.randn(128, generator=g)
    samples = 4096
    q = quantize(base.repeat(samples), bits=bits, block_size=64, stochastic=True, generator=g)
    mean = dequantize(q).view(samples, 128).mean(dim=0)
    scale = _per_element(quantize(base, bits=bits, block_size=64))
    # each rounding is off by a fraction f of a step, with standard deviation
    # scale * sqrt(f (1 - f)) <= scale / 2; allow 5 standard deviations of the mean
    tol = 5 * scale / 2 / samples**0.5
    assert ((mean - base).abs() <= tol).all()
    # ... which round to nearest does not meet: the test tells the two apart
    nearest = dequantize(quantize(base, bits=bits, block_size=64))
    assert ((nearest - base).abs() > tol).any()


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_rounding_repeats_with_the_seed(bits) -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(2))

    def codes(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return quantize(x, bits=bits, block_size=256, stochastic=True, generator=gen).data

    assert torch.equal(codes(7), codes(7))
    assert not torch.equal(codes(7), codes(8))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("numel", "block_size"), [(0, 64), (1, 64), (5000, 2048), (4096, 64)])
def test_nbytes_is_the_formula(bits, numel, block_size) -> None:
    q = quantize(torch.randn(numel), bits=bits, block_size=block_size)
    assert q.nbytes == quantized_nbytes(numel, bits=bits, block_size=block_size)
    blocks = -(-numel // block_size)
    assert q.nbytes == blocks * block_size * bits // 8 + 4 * blocks


@pytest.mark.parametrize(("bits", "ratio"), [(8, 1 / 4), (4, 1 / 8)])
def test_nbytes_against_fp32(bits, ratio) -> None:
    numel = 1 << 20
    q = quantize(torch.randn(numel), bits=bits)
    # the scales add 4 bytes per 2048 elements: 0.05% of the fp32 bytes
    assert q.nbytes / (numel * 4) == pytest.approx(ratio, abs=1e-3)


def test_numel_not_a_multiple_of_the_block() -> None:
    x = torch.randn(5000)
    for bits in (4, 8):
        q = quantize(x, bits=bits, block_size=2048)
        assert q.numel == 5000
        assert q.scales.shape == (3,)
        assert q.data.numel() == 3 * 2048 * bits // 8  # the last block is padded
        # the padding does not shrink the last block's scale below its own absmax
        assert q.scales[2].item() * _QMAX[bits] >= x[4096:].abs().max().item() * (1 - 1e-6)
        assert dequantize(q).shape == (5000,)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(0,), (0, 3)])
def test_empty_tensor(bits, shape) -> None:
    x = torch.empty(shape, dtype=torch.bfloat16)
    q = quantize(x, bits=bits, stochastic=True)
    assert q.numel == 0
    assert q.nbytes == 0
    y = dequantize(q)
    assert y.shape == (0,)
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shape_dtype_and_input_left_alone(dtype) -> None:
    x = torch.randn(6, 50).to(dtype).t()  # not contiguous
    before = x.clone()
    q = quantize(x, bits=8, block_size=32)
    assert q.dtype == dtype
    assert torch.equal(x, before)
    y = dequantize(q)
    assert y.dtype == dtype
    assert torch.allclose(y.view(50, 6).float(), x.float(), atol=x.float().abs().max().item() / 100)


def test_out() -> None:
    x = torch.randn(300, dtype=torch.bfloat16)
    q = quantize(x, bits=4, block_size=64)
    out = torch.empty(300, dtype=torch.bfloat16)
    assert dequantize(q, out=out) is out
    assert torch.equal(out, dequantize(q))
    for wrong in (
        torch.empty(299, dtype=torch.bfloat16),
        torch.empty(10, 30, dtype=torch.bfloat16),
        torch.empty(300, dtype=torch.float32),
    ):
        with pytest.raises(ValueError, match=r"out: expected a flat torch\.bfloat16 tensor of 300"):
            dequantize(q, out=wrong)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_raises_with_the_index(bad) -> None:
    x = torch.zeros(3, 1000)
    x[1, 7] = bad
    x[2, 999] = float("nan")
    with pytest.raises(QuantizationError) as info:
        quantize(x)
    assert info.value.count == 2
    assert info.value.index == 1007
    message = str(info.value)
    assert "2 of 3000 elements are not finite" in message
    assert "flat index 1007 (index (1, 7) of shape (3, 1000))" in message
    assert isinstance(info.value, zcomm.CommError)


def test_non_finite_bf16_and_stochastic() -> None:
    x = torch.ones(10, dtype=torch.bfloat16)
    x[3] = float("inf")
    with pytest.raises(QuantizationError, match=r"1 of 10 elements .* flat index 3$"):
        quantize(x, bits=4, block_size=4, stochastic=True)


@pytest.mark.parametrize("bits", [0, 2, 16, True, 8.0, "8"])
def test_bad_bits(bits) -> None:
    with pytest.raises(ValueError, match="bits: expected 4 or 8"):
        quantize(torch.ones(4), bits=bits)
    with pytest.raises(ValueError, match="bits: expected 4 or 8"):
        quantized_nbytes(4, bits=bits, block_size=2)


@pytest.mark.parametrize(
    ("bits", "block_size", "match"),
    [
        (8, 0, "block_size: expected a positive int"),
        (8, -2, "block_size: expected a positive int"),
        (8, 2.0, "block_size: expected a positive int"),
        (8, True, "block_size: expected a positive int"),
        (4, 3, "block_size: must be even for bits=4"),
    ],
)
def test_bad_block_size(bits, block_size, match) -> None:
    with pytest.raises(ValueError, match=match):
        quantize(torch.ones(4), bits=bits, block_size=block_size)
    with pytest.raises(ValueError, match=match):
        quantized_nbytes(4, bits=bits, block_size=block_size)


def test_bad_numel_and_input_dtype() -> None:
    with pytest.raises(ValueError, match="numel: expected a non-negative int"):
        quantized_nbytes(-1, bits=8, block_size=4)
    with pytest.raises(TypeError, match=r"x: expected a floating-point tensor, got torch\.int64"):
        quantize(torch.ones(4, dtype=torch.int64))


def test_quantized_checks_its_fields() -> None:
    q = quantize(torch.randn(100), bits=4, block_size=32)
    with pytest.raises(ValueError, match=r"Quantized\(data=...\)"):
        Quantized(q.data[:-1], q.scales, q.numel, q.bits, q.block_size, q.dtype)
    with pytest.raises(ValueError, match=r"Quantized\(data=...\)"):
        Quantized(q.data.to(torch.int8), q.scales, q.numel, q.bits, q.block_size, q.dtype)
    with pytest.raises(ValueError, match=r"Quantized\(scales=...\)"):
        Quantized(q.data, q.scales.double(), q.numel, q.bits, q.block_size, q.dtype)
    with pytest.raises(ValueError, match=r"Quantized\(dtype=...\)"):
        Quantized(q.data, q.scales, q.numel, q.bits, q.block_size, torch.int32)
    # rebuilt from its buffers (as a receiver would), it dequantizes the same
    again = Quantized(q.data.clone(), q.scales.clone(), 100, 4, 32, torch.float32)
    assert torch.equal(dequantize(again), dequantize(q))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_matches_cpu(bits) -> None:
    x = torch.randn(100_003, dtype=torch.bfloat16) * 3
    x[:500] = 0
    q = quantize(x, bits=bits, block_size=512)
    qc = quantize(x.cuda(), bits=bits, block_size=512)
    assert qc.data.is_cuda
    assert torch.equal(qc.data.cpu(), q.data)
    assert torch.equal(qc.scales.cpu(), q.scales)
    assert torch.equal(dequantize(qc).cpu(), dequantize(q))
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = quantize(x.cuda(), bits=bits, block_size=512, stochastic=True, generator=gen)
    ref, out = x.cuda().float(), dequantize(s).float()
    tol = _per_element(s) + _F32_SLACK * ref.abs() + 2.0**-8 * out.abs()
    assert bool(((ref - out).abs() <= tol).all())
