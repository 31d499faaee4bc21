"""``deepspeed.runtime.zero.partition_parameters.CUDAQuantizer`` (qwZ's quantizer, which
DeepSpeed's ZeRO++ tests import) over zcomm's: DeepSpeed's groups, int8 codes, its dtypes."""

from __future__ import annotations

import pytest
import torch

from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_in_deepspeeds_groups(dtype: torch.dtype) -> None:
    quantizer = CUDAQuantizer()
    param = torch.randn(64, 400, dtype=dtype)
    codes, scales = quantizer.quantize(param)
    # DeepSpeed's grouping: 25600 elements in 4 groups of 6400 (a multiple of 8, under 8000)
    assert codes.dtype == torch.int8
    assert codes.shape == (25600,)
    assert scales.shape == (4,)
    assert scales.dtype == torch.float32
    back = quantizer.dequantize(codes, scales, dtype=dtype)
    assert back.dtype == dtype
    assert quantizer.dequantize(codes, scales).dtype == torch.float16  # DeepSpeed's default
    groups = param.float().reshape(4, -1)
    half = (groups.abs().amax(dim=1) / 127 / 2).repeat_interleave(6400)
    error = (back.float() - param.float().reshape(-1)).abs()
    slack = 0 if dtype == torch.float32 else param.float().abs().reshape(-1) / 128  # rounding
    assert bool((error <= half * 1.0001 + slack).all())
    assert torch.equal(quantizer.quantize(param, groups=4)[0], codes)


def test_sizes_that_do_not_split_are_named() -> None:
    with pytest.raises(ValueError, match="12 elements do not split into 5 equal groups"):
        CUDAQuantizer().quantize(torch.ones(12), groups=5)
    with pytest.raises(ValueError, match="groups of a multiple of 8"):
        CUDAQuantizer().quantize(torch.ones(7))
