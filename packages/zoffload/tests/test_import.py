import importlib.metadata
import os
import subprocess
import sys

import zoffload

_LEAN = """
import sys, torch
import zoffload
assert not torch.cuda.is_initialized(), "importing zoffload initialized CUDA"
assert "cupy" not in sys.modules, "importing zoffload imported CuPy"
h = zoffload.offload({"x": torch.ones(3)})
h.reload()
assert not torch.cuda.is_initialized(), "a CPU offload initialized CUDA"
print("lean ok")
"""


def test_version_matches_metadata() -> None:
    assert zoffload.__version__ == importlib.metadata.version("zoffload")


def test_import_does_not_initialize_cuda() -> None:
    # In a fresh interpreter, as torchao's test_lean_import does.
    done = subprocess.run(
        [sys.executable, "-c", _LEAN],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "lean ok" in done.stdout


def test_enums_have_deepspeeds_values() -> None:
    assert [e.value for e in zoffload.OffloadDeviceEnum] == ["none", "cpu", "nvme"]
    assert [e.value for e in zoffload.OffloadStateTypeEnum] == [
        "optim_states",
        "hp_params",
        "lp_params",
        "lp_grads",
        "contiguous_grad_buffer",
    ]
    assert zoffload.OffloadDeviceEnum.cpu == "cpu"
    assert zoffload.OffloadDeviceEnum("nvme") is zoffload.OffloadDeviceEnum.nvme
    assert torch_device_of(zoffload.OffloadDeviceEnum.cpu) == "cpu"


def torch_device_of(value: zoffload.OffloadDeviceEnum) -> str:
    import torch

    return str(torch.device(value.value))
