"""ZeRO++ quantized communication through the config (``zero_quantized_weights``,
``zero_quantized_gradients``): training close to plain PyTorch and not equal to the exact run,
what is saved exact, refusals; each with offload_param, offload_optimizer, bf16, fp16, and on
2 nodes x 2 with hpZ and hybrid sharding, alone and all together; the fp32 masters exactly what
the optimizer computed, never a quantized copy; checkpoints that hold them and resume."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zengine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from ._helpers import (
    LR,
    TinyGPT,
    checkpoint_engine,
    engine_config,
    global_batches,
    mixed_precision_losses,
    plain_losses,
    train_engine,
    train_global,
)


def _config(stage: int = 3, **zero: Any) -> dict[str, Any]:
    cfg = engine_config(stage)
    cfg["zero_optimization"] |= zero
    return cfg


class TestQuantizedCommunication(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("keys", [("weights",), ("weights", "gradients")])
    def test_training_follows_plain_pytorch_and_the_saved_weights_are_exact(
        self, tmp_path: Path, keys: tuple[str, ...]
    ) -> None:
        torch.manual_seed(0)
        model = TinyGPT()
        reference, exact = copy.deepcopy(model), copy.deepcopy(model)
        data = global_batches(4, 2 * 2)
        quantized = {f"zero_quantized_{key}": True for key in keys}
        cfg = _config(stage3_gather_16bit_weights_on_model_save=True, **quantized)
        engine, *_ = zengine.initialize(model=model, config=cfg)
        losses = train_engine(engine, data)
        other, *_ = zengine.initialize(model=exact, config=_config())
        unquantized = train_engine(other, data)
        expected = plain_losses(reference, data, lr=LR)
        # int8 blocks of 2048: weights and gradients each within half a scale
        torch.testing.assert_close(losses, expected, rtol=1e-2, atol=0)
        assert losses != unquantized  # the gathers were quantized
        torch.testing.assert_close(unquantized, expected, rtol=1e-5, atol=0)
        # what is saved is the shards, exact: the 16-bit save equals the fp32 masters
        assert engine.save_16bit_model(tmp_path)  # pytorch_model.bin
        masters = {n: zengine.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
        if zcomm.get_rank() == 0:
            saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
            for name, master in masters.items():
                assert master is not None
                assert torch.equal(saved[name], master), name

    def test_it_is_stage_3s(self) -> None:
        for key in ("weights", "gradients"):
            with pytest.raises(ValueError, match=f"zero_quantized_{key}: ZeRO\\+\\+'s q"):
                zengine.initialize(
                    model=TinyGPT(), config=_config(2, **{f"zero_quantized_{key}": True})
                )


# -- compositions (#26 item 5): each option alone and all together, at 2 ranks and 2 x 2 ----------

STEPS = 4
QUANTIZED: dict[str, dict[str, Any]] = {
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
}
# fp16's dynamic scale starts where the first step overflows (hysteresis 1: the scale halves at
# once): the loss scaler skips a step whose gradients went through the quantized reduction
FP16: dict[str, Any] = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 18,
    "hysteresis": 1,
}
OPTIONS: dict[str, dict[str, Any]] = {
    "offload_param": {"zero_optimization": {"offload_param": {"device": "cpu"}}},
    "offload_optimizer": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": FP16},
    # 2 x 2 only. hpZ: no reuse, so every unit is gathered again in the backward, from the
    # secondary shards a quantized forward kept, within the node
    "hpZ": {"zero_optimization": {"zero_hpz_partition_size": 2, "stage3_max_reuse_distance": 0}},
    "hybrid": {"zero_optimization": {"mics_shard_size": 2}},  # shard groups of a node
}
# Quantized against the same configuration unquantized. qwZ computes with weights each within
# half its int8 block's scale (1/254 of the block's largest magnitude, 0.4%) and qgZ steps with
# gradients as close; over 4 steps of TinyGPT the losses move by at most 2.6e-3 of themselves
# (bf16 with both at 2 ranks; 1.9e-3 on 2 x 2): the bound is about twice that. The unquantized
# runs are held to the exact runs' bounds (1e-5 of plain PyTorch in fp32, bit-exact with
# `mixed_precision_losses` at 2 ranks).
RTOL = 5e-3


class _Run(NamedTuple):
    losses: list[float]
    quantized: set[str]  # the quantized collectives zpartition called
    crossed: int  # bytes this rank's collectives moved across nodes
    skipped: int  # steps the fp16 loss scaler skipped


def _compose(options: Sequence[str], quantized: str | None = None, **zero: Any) -> dict[str, Any]:
    cfg = _config(**zero)
    for name in options:
        for key, value in OPTIONS[name].items():
            cfg[key] = cfg[key] | value if key == "zero_optimization" else value
    if quantized is not None:
        cfg["zero_optimization"] |= QUANTIZED[quantized]
    return cfg


def _train(cfg: dict[str, Any], data: list[torch.Tensor]) -> _Run:
    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = zengine.initialize(model=model, config=cfg)
    zcomm.enable_comm_accounting()
    zcomm.reset_comm_accounting()
    try:
        with _calls() as calls:
            losses = train_engine(engine, data)
        crossed = zcomm.comm_bytes_by_link()["inter_node"]
    finally:
        zcomm.enable_comm_accounting(False)
        zcomm.reset_comm_accounting()
    engine.destroy()
    return _Run(losses, set(calls), crossed, engine.skipped_steps)


_QUANTIZED_OPS = ("all_gather_quantized", "reduce_scatter_quantized")


@contextlib.contextmanager
def _calls() -> Iterator[Counter[str]]:
    """Counts zpartition's calls of zcomm's quantized collectives (it calls them as zcomm's
    attributes) while in the block."""
    calls: Counter[str] = Counter()
    originals = {name: getattr(zcomm, name) for name in _QUANTIZED_OPS}

    def spy(name: str, collective: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return collective(*args, **kwargs)

        return counted

    for name, collective in originals.items():
        setattr(zcomm, name, spy(name, collective))
    try:
        yield calls
    finally:
        for name, collective in originals.items():
            setattr(zcomm, name, collective)


def _compositions(
    options: Sequence[str],
    data: list[torch.Tensor],
    expected: list[float] | None = None,
    rtol: float = 0.0,
    kinds: Sequence[str] = tuple(QUANTIZED),
) -> dict[str | None, _Run]:
    """`options` trained unquantized (None; within `rtol` of `expected` where given) and with
    each of `kinds` of `QUANTIZED`: every quantized run close to the unquantized one and not
    equal to it, through its quantized collectives."""
    runs = {q: _train(_compose(options, q), data) for q in (None, *kinds)}
    exact = runs[None]
    assert not exact.quantized
    if expected is not None:
        torch.testing.assert_close(exact.losses, expected, rtol=rtol, atol=0)
    for q in kinds:
        run = runs[q]
        torch.testing.assert_close(run.losses, exact.losses, rtol=RTOL, atol=0, msg=q)
        assert run.losses != exact.losses, (options, q)
        # qwZ's first forward computes with quantized weights already; qgZ alone only changes
        # what the steps compute, and nothing was stepped before the first loss
        assert (run.losses[0] == exact.losses[0]) == (q == "qgZ"), (options, q)
        went = {"all_gather_quantized"} if "qwZ" in q else set()
        went |= {"reduce_scatter_quantized"} if "qgZ" in q else set()
        assert run.quantized == went, (options, q)
        # fp16: the loss scaler skipped the first step, whose gradients overflowed in the
        # backward (qgZ sends their blocks as NaN, which the overflow check finds)
        assert (run.skipped >= 1) == (exact.skipped >= 1) == ("fp16" in options), (options, q)
    return runs


def _losses(runs: dict[str | None, _Run]) -> dict[str | None, list[float]]:
    return {q: run.losses for q, run in runs.items()}


def _half(dtype: torch.dtype, data: list[torch.Tensor], world: int) -> list[float]:
    torch.manual_seed(0)
    fp16 = FP16 if dtype == torch.float16 else None
    return mixed_precision_losses(TinyGPT(), data, dtype, world=world, fp16=fp16)[0]


class TestQuantizedCompositions(DistributedTest):
    world_size = 2

    def test_each_option_alone_and_all_together(self) -> None:
        data = global_batches(STEPS, 2 * 2)
        torch.manual_seed(0)
        plain = plain_losses(TinyGPT(), data, lr=LR)
        base = _losses(_compositions((), data, plain, rtol=1e-5))
        # offloading moves the shards and the optimizer's step to the host, not the arithmetic:
        # every run is bit-identical to the one without it, quantized or not
        for option in ("offload_param", "offload_optimizer"):
            assert _losses(_compositions((option,), data)) == base, option
        # 16-bit: the unquantized runs bit-exact with DeepSpeed's mixed precision in plain
        # PyTorch (two ranks' sum is one rounding; see test_engine's half-precision test)
        half = {
            name: _losses(_compositions((name,), data, _half(dtype, data, 2)))
            for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
        }
        # all together: both quantizations with every option
        options = ("offload_param", "offload_optimizer", "fp16")
        together = _compositions(options, data, kinds=["qwZ+qgZ"])
        assert _losses(together) == {q: half["fp16"][q] for q in together}
        assert {q: run.skipped for q, run in together.items()} == dict.fromkeys(together, 1)


class TestQuantizedCompositionsOnTwoNodes(DistributedTest):
    world_size = 4

    def test_each_option_alone_and_all_together(self) -> None:
        zcomm.set_node_layout(2)  # 2 nodes x 2: qgZ is hierarchical over the world
        data = global_batches(STEPS, 2 * 4)
        torch.manual_seed(0)
        plain = plain_losses(TinyGPT(), data, lr=LR)
        base = _compositions((), data, plain, rtol=1e-5)
        hpz = _compositions(("hpZ",), data, plain, rtol=1e-5)
        for q in (None, *QUANTIZED):  # the backward's gathers stayed in the node
            assert 0 < hpz[q].crossed < base[q].crossed, q
        _compositions(("hybrid",), data, plain, rtol=1e-5)
        # all together: both quantizations with every option. fp16: the first step overflows;
        # at the halved scale the reference's fp16 sum of four ranks would overflow too, the
        # shard groups' sums of two do not
        options = ("hybrid", "offload_param", "offload_optimizer")
        runs = _compositions((*options, "fp16"), data, kinds=["qwZ+qgZ"])
        assert {q: run.skipped for q, run in runs.items()} == dict.fromkeys(runs, 1)
        # four ranks' bf16 sums round in gloo's order, not the reference's (6e-5 apart here)
        options = ("hpZ", "offload_param", "offload_optimizer")
        expected = _half(torch.bfloat16, data, 4)
        _compositions((*options, "bf16"), data, expected, rtol=2e-4, kinds=["qwZ+qgZ"])


# -- the masters: never the quantized copy ------------------------------------------------------


def _replay(cfg: dict[str, Any], steps: int = 3) -> None:
    """Train with `cfg`, and after every step check that each rank's fp32 master pieces are
    exactly what torch's fused AdamW (DeepSpeed's "Adam" here) computes from the gradients the
    engine reduced, applied to copies of the first masters that nothing gathers: a master that
    ever held a quantized value (or the dequantized rows of a gather) steps to another value."""
    world, rank = zcomm.get_world_size(), zcomm.get_rank()
    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = zengine.initialize(model=model, config=cfg)
    params = list(model.parameters())
    pieces = [zengine.safe_get_local_fp32_param(p) for p in params]
    masters = [piece.detach().clone() for piece in pieces if piece is not None]
    assert len(masters) == len(params)
    reference = torch.optim.AdamW(masters, lr=LR, weight_decay=0.01, fused=True)
    for tokens in global_batches(steps, 2 * world):
        engine.backward(engine(tokens.view(world, -1, tokens.shape[-1])[rank]))
        for master, p in zip(masters, params, strict=True):
            grad = zengine.safe_get_local_grad(p)
            assert grad is not None
            master.grad = grad.to(torch.float32, copy=True)  # bf16's are widened to step
        engine.step()
        reference.step()
        for name, master in zip((n for n, _ in model.named_parameters()), masters, strict=True):
            stepped = zengine.safe_get_local_fp32_param(model.get_parameter(name))
            assert stepped is not None
            assert torch.equal(stepped, master), name
    # and the check has teeth: the masters are far from int8's grid, so a master replaced by
    # its quantized copy would differ (the few on it are each block's largest and zeros)
    flat = torch.cat([m.detach().view(-1) for m in masters])
    on_grid = zcomm.dequantize(zcomm.quantize(flat)) == flat
    assert on_grid.float().mean() < 0.05
    engine.destroy()


class TestQuantizedMasters(DistributedTest):
    world_size = 2

    def test_the_masters_are_what_the_optimizer_computed(self) -> None:
        both = QUANTIZED["qwZ+qgZ"]
        _replay(_config(**both))  # fp32: the shards the gathers read are the masters
        _replay(_compose(("bf16", "offload_param", "offload_optimizer"), "qwZ+qgZ"))

    def test_checkpoints_hold_the_masters_and_resume(self, tmp_path: Path) -> None:
        # qwZ with prefetching (the default): the fresh engine's first step gathers each unit
        # alone (no trace yet), the uninterrupted engine's prefetch batches several units in
        # one quantized gather whose blocks run across them: the resumed weights are a
        # rounding apart, the losses close. Without prefetching (or with qgZ alone, whose
        # buckets are alike in every step) the resume is bit-identical.
        for i, (quantized, zero, exact) in enumerate(
            (
                ("qwZ+qgZ", {}, False),
                ("qgZ", {}, True),
                ("qwZ+qgZ", {"stage3_prefetch_bucket_size": 0}, True),
            )
        ):
            _resume(tmp_path / str(i), {**QUANTIZED[quantized], **zero}, exact=exact)


def _resume(path: Path, zero: dict[str, Any], *, exact: bool, **extra: Any) -> None:
    """Train 2 steps, save, train 2 more; the save holds the masters exactly (consolidated, and
    each rank's pieces and optimizer state once loaded into an engine of other weights), and
    that engine's 2 steps equal the uninterrupted ones (`exact`) or come close."""
    section = {"stage": 3, "stage3_param_persistence_threshold": 16, **zero}
    world = zcomm.get_world_size()
    data = global_batches(4, 2 * world)
    engine = checkpoint_engine(3, zero_optimization=section, **extra)
    train_global(engine, data[:2])
    engine.save_checkpoint(path, tag="t")
    named = list(engine.module.named_parameters())
    full = {n: zengine.safe_get_full_fp32_param(p) for n, p in named}
    saved = [_local_state(p) for _, p in named]
    straight = train_global(engine, data[2:])
    resumed = checkpoint_engine(3, seed=1, zero_optimization=section, **extra)
    resumed.load_checkpoint(path, tag="t")
    loaded = resumed.module.named_parameters()
    for (name, p), mine in zip(loaded, saved, strict=True):
        for a, b in zip(mine, _local_state(p), strict=True):
            assert torch.equal(a, b), name
    again = train_global(resumed, data[2:])
    if exact:
        assert again == straight
    else:
        torch.testing.assert_close(again, straight, rtol=RTOL, atol=0)
    if zcomm.get_rank() == 0:
        consolidated = get_fp32_state_dict_from_zero_checkpoint(path, tag="t")
        for name, master in full.items():
            value = consolidated[name]
            assert isinstance(value, torch.Tensor)
            assert master is not None
            assert torch.equal(value, master), name
    zcomm.barrier()  # the files stay until every rank has read them


def _local_state(p: torch.Tensor) -> list[torch.Tensor]:
    """This rank's piece of `p`'s fp32 master and of its Adam state, copied."""
    pieces = [zengine.safe_get_local_fp32_param(p)]
    pieces += [zengine.safe_get_local_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
    assert all(piece is not None for piece in pieces)
    return [piece.detach().clone() for piece in pieces if piece is not None]


class TestQuantizedMastersOnTwoNodes(DistributedTest):
    world_size = 4

    def test_the_masters_are_what_the_optimizer_computed(self) -> None:
        zcomm.set_node_layout(2)
        # hpZ: the secondary shards hold a quantized forward's dequantized rows
        _replay(_compose(("hpZ",), "qwZ+qgZ"))

    def test_checkpoints_hold_the_masters_and_resume(self, tmp_path: Path) -> None:
        zcomm.set_node_layout(2)
        zero = {
            **QUANTIZED["qwZ+qgZ"],
            **OPTIONS["hpZ"]["zero_optimization"],
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
            "stage3_prefetch_bucket_size": 0,
        }
        _resume(tmp_path, zero, exact=True, bf16={"enabled": True})
