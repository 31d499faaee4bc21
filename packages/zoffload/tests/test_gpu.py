"""CUDA: pinned pool, packed transfers, streams, both backends (run by `nox -s tests-gpu`)."""

from __future__ import annotations

import pytest
import torch

import zoffload
from zoffload import _cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(params=["torch", "cupy"])
def backend(request, monkeypatch):
    if request.param == "cupy":
        pytest.importorskip("cupy")
    monkeypatch.setenv("ZOFFLOAD_BACKEND", request.param)
    _cuda.cupy.cache_clear()
    _cuda._copiers.clear()
    yield request.param
    _cuda.cupy.cache_clear()
    _cuda._copiers.clear()


def gpu_state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"small{i}": torch.randn(17 * i + 1, device="cuda", generator=g) for i in range(300)}
    state["big"] = torch.randn(8 << 20, device="cuda", generator=g)
    state["bf16"] = torch.randn(1 << 20, device="cuda", generator=g).bfloat16()
    state["view"] = torch.randn(64, 64, device="cuda", generator=g).t()
    return state


@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("non_blocking", [False, True])
def test_gpu_round_trip(backend, tmp_path, storage_bytes, device, pin_memory, non_blocking):
    off = zoffload.Offloader(pool=zoffload.HostPool(), nvme_path=tmp_path)
    state = gpu_state()
    expected = {k: storage_bytes(v) for k, v in state.items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = off.offload(
        state, device, pin_memory=pin_memory, non_blocking=non_blocking, verify=True
    )
    handle.wait()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= 0.99 * handle.nbytes
    assert handle.pinned is pin_memory
    want = expected["big"].view(torch.float32).to("cuda").sum()
    handle.reload(non_blocking=non_blocking)
    probe = state["big"].sum()  # queued on the current stream: must see the reloaded bytes
    handle.wait()
    assert torch.equal(probe, want)
    for k, v in state.items():
        assert torch.equal(storage_bytes(v), expected[k]), k
    off.close()
    off.pool.close()


def test_hundred_cycles_no_pinned_growth(backend):
    pool = zoffload.HostPool()
    off = zoffload.Offloader(pool=pool)
    state = gpu_state()
    first = None
    for cycle in range(100):
        off.offload(state, "cpu", non_blocking=True).reload(non_blocking=True).wait()
        if cycle == 0:
            first = pool.stats()
    last = pool.stats()
    assert first is not None
    assert first.pinned_bytes > 0
    assert last.blocks_allocated == first.blocks_allocated
    assert last.pinned_bytes == first.pinned_bytes
    off.close()
    pool.close()


def test_pinned_block_is_exact_size(backend):
    pool = zoffload.HostPool()
    region = pool.allocate(20 * 4096 + 1, pinned=True)
    assert region.pinned
    assert region.tensor.is_pinned()
    assert pool.stats().pinned_bytes == 21 * 4096  # not 32 pages, as torch would round to
    region.release()
    pool.close()
