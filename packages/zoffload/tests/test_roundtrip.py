"""Offload and reload are bit-exact and really empty the storages (CPU tensors, real files)."""

from __future__ import annotations

import pytest
import torch

import zoffload
from zoffload import OffloadDeviceEnum as Dev

from .conftest import swap_files

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.complex64,
    torch.float8_e4m3fn,
]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (1000, 33)]
DEVICES = [Dev.cpu, Dev.nvme]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    # Random bit patterns, NaNs and all: bytes must come back, not values.
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape).clone()


def many_tensors() -> dict[str, torch.Tensor]:
    out = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            out[f"{dtype}-{shape}"] = random_tensor(shape, dtype, 100 * i + j)
    out["bool"] = torch.rand(100, generator=torch.Generator().manual_seed(1)) > 0.5
    base = random_tensor((64, 48), torch.float32, 7)
    out["transposed"] = base.t()  # non-contiguous view of its own storage
    strided = random_tensor((1000,), torch.float16, 8)
    out["strided"] = strided[3::7]  # a view with an offset and a stride
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("verify", [False, True])
def test_many_dtypes_and_shapes_round_trip_bit_exact(offloader, storage_bytes, device, verify):
    tensors = many_tensors()
    before = {k: storage_bytes(t) for k, t in tensors.items()}
    meta = {k: (t.shape, t.stride(), t.storage_offset(), t.dtype) for k, t in tensors.items()}
    storages = {k: t.untyped_storage()._cdata for k, t in tensors.items()}
    handle = offloader.offload(tensors, device, verify=verify)
    assert handle.state == "offloaded"
    assert handle.nbytes == sum(b.numel() for b in before.values())
    for t in tensors.values():
        assert t.untyped_storage().nbytes() == 0  # the memory is really given back
    handle.reload()
    assert handle.state == "resident"
    for k, t in tensors.items():
        assert t.untyped_storage()._cdata == storages[k]  # the same storage object
        assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == meta[k]
        assert torch.equal(storage_bytes(t), before[k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_views_sharing_a_storage_move_it_once(offloader, device):
    base = torch.arange(100, dtype=torch.float32)
    tensors = {"head": base[:10], "tail": base[90:], "even": base[::2]}
    unnamed = base[40:50]  # not named, shares the storage: emptied and restored too
    expected = base.clone()
    handle = offloader.offload(tensors, device)
    assert handle.nbytes == 400  # one storage, whole, counted once
    assert unnamed.untyped_storage().nbytes() == 0
    assert id(zoffload.handle_of(unnamed)) == id(handle)
    handle.reload()
    assert torch.equal(base, expected)
    assert torch.equal(unnamed, expected[40:50])
    assert zoffload.handle_of(base) is None


def test_parameters_keep_identity_and_autograd(offloader):
    layer = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {f"{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    state.update(dict(layer.named_parameters()))
    grads = {f"{n}.grad": p.grad for n, p in layer.named_parameters() if p.grad is not None}
    state.update(grads)
    expected = {k: v.clone() for k, v in state.items()}
    handle = offloader.offload(state, Dev.nvme, verify=True)
    handle.reload()
    for k, v in state.items():
        assert torch.equal(v, expected[k]), k
    assert layer.weight.grad is grads["weight.grad"]
    layer(torch.randn(2, 8)).sum().backward()  # training continues on the same tensors
    opt.step()


@pytest.mark.parametrize("device", DEVICES)
def test_non_blocking_returns_a_waitable_handle(offloader, device):
    tensors = {f"t{i}": torch.randn(5000 + i) for i in range(8)}
    expected = {k: v.clone() for k, v in tensors.items()}
    handle = offloader.offload(tensors, device, non_blocking=True)
    assert handle.wait() is handle
    assert handle.done()
    assert handle.state == "offloaded"
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
    assert handle.reload(non_blocking=True) is handle
    handle.wait()
    assert handle.state == "resident"
    assert all(torch.equal(tensors[k], expected[k]) for k in tensors)


def test_reload_without_wait_waits_for_the_offload(offloader):
    tensors = {"x": torch.randn(100_000)}
    expected = tensors["x"].clone()
    handle = offloader.offload(tensors, Dev.nvme, non_blocking=True)
    handle.reload()  # no wait() in between: reload completes the offload first
    assert torch.equal(tensors["x"], expected)


def test_device_none_frees_without_copy_and_reallocates(offloader):
    buf = torch.ones(1000)
    handle = offloader.offload({"buf": buf}, Dev.none)
    assert buf.untyped_storage().nbytes() == 0
    assert handle.device == Dev.none
    assert id(zoffload.handle_of(buf)) == id(handle)
    assert offloader.pool.stats().blocks == 0  # nothing was copied anywhere
    handle.reload()
    assert buf.untyped_storage().nbytes() == 4000  # memory back, contents undefined
    with pytest.raises(ValueError, match="verify"):
        offloader.offload({"buf": buf}, Dev.none, verify=True)


def test_handle_properties_and_location(offloader, tmp_path):
    t = torch.randn(10)
    assert zoffload.handle_of(t) is None
    handle = offloader.offload({"t": t}, "nvme", nvme_path=tmp_path / "elsewhere")
    assert handle.device is Dev.nvme
    assert handle.devices == frozenset({torch.device("cpu")})
    assert handle.names == ("t",)
    assert handle.tensors["t"] is t
    assert handle.path is not None
    assert handle.path.parent.parent == tmp_path / "elsewhere"  # in this process's folder
    assert handle.path.exists()
    assert handle.offloaded
    assert id(zoffload.handle_of(t)) == id(handle)
    assert "nvme" in repr(handle)
    handle.reload()
    assert handle.path is None
    assert not handle.offloaded
    assert not swap_files(tmp_path / "elsewhere")  # the file is gone after reload


def test_double_offload_and_double_reload_are_errors(offloader):
    a = torch.randn(4)
    alias = a[1:]
    handle = offloader.offload({"a": a})
    with pytest.raises(zoffload.OffloadError, match="already offloaded"):
        offloader.offload({"alias": alias})
    handle.reload()
    with pytest.raises(zoffload.OffloadError, match="resident"):
        handle.reload()
    again = offloader.offload({"a": a})  # a new cycle on the same tensor is fine
    again.reload()


def test_bad_arguments_are_named_and_touch_nothing(offloader):
    good = torch.randn(4)
    with pytest.raises(TypeError, match="'x'"):
        offloader.offload({"good": good, "x": [1, 2]})
    with pytest.raises(zoffload.OffloadError, match=r"'m'.*meta"):
        offloader.offload({"good": good, "m": torch.empty(3, device="meta")})
    with pytest.raises(zoffload.OffloadError, match=r"'s'.*strided"):
        offloader.offload({"good": good, "s": torch.eye(3).to_sparse()})
    foreign = torch.frombuffer(bytearray(16), dtype=torch.float32)
    with pytest.raises(zoffload.OffloadError, match=r"'f'.*not resizable"):
        offloader.offload({"good": good, "f": foreign})
    with pytest.raises(ValueError, match="nvme_path"):
        zoffload.Offloader(pool=offloader.pool).offload({"good": good}, "nvme")
    with pytest.raises(ValueError, match="'disk'"):
        offloader.offload({"good": good}, "disk")
    assert good.untyped_storage().nbytes() == 16
    assert zoffload.handle_of(good) is None


def test_verify_catches_bytes_changed_while_away(offloader):
    t = torch.arange(1000, dtype=torch.int32)
    handle = offloader.offload({"t": t}, Dev.cpu, verify=True)
    region = handle._region
    assert region is not None
    region.tensor[8] ^= 1  # a flipped bit in host memory
    with pytest.raises(zoffload.OffloadChecksumError) as info:
        handle.reload()
    assert info.value.names == ["t"]


def test_the_module_level_offload_uses_the_default_pool():
    t = torch.randn(100)
    expected = t.clone()
    handle = zoffload.offload({"t": t})
    assert zoffload.default_pool().stats().in_use_bytes > 0
    handle.reload()
    assert torch.equal(t, expected)
    assert zoffload.default_offloader() is zoffload.default_offloader()


def test_fingerprints_see_moved_and_flipped_bytes():
    from zoffload._storage import device_hash, fingerprint

    data = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=torch.Generator())
    swapped = data.clone()
    swapped[[0, 4]] = swapped[[4, 0]]
    flipped = data.clone()
    flipped[4098] ^= 0x80
    for f in (fingerprint, device_hash):
        assert f(data) == f(data.clone())
        if not torch.equal(swapped, data):
            assert f(swapped) != f(data)
        assert f(flipped) != f(data)
        assert f(data[:-1]) != f(data)
