"""The engine on CUDA at world size 1 (NCCL): every ZeRO stage in fp32, bf16 and fp16 with
dynamic loss scaling, and ZeRO-Offload / ZeRO-Infinity (`offload_optimizer` and `offload_param`
to cpu and nvme), each trained against plain PyTorch's run of the same precision on the same GPU,
with the states where the config puts them. Needs a GPU: run by `nox -s tests-gpu`; the same
configurations on CPU are test_engine.py's and test_offload_optimizer.py's."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch

import zengine
from zcomm.testing import DistributedTest

from ._helpers import TinyGPT, engine_config, global_batches, mixed_precision_losses, plain_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# bf16 and fp16 runs differ from the reference by the embedding's backward (atomic adds, in
# another order on each run), which the half precision rounds differently.
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2}


def _precision(config: dict[str, Any], precision: str) -> dict[str, Any] | None:
    """Sets the config's section for `precision`; the fp16 section, which the reference needs."""
    if precision == "fp32":
        return None
    section: dict[str, Any] = {"enabled": True}
    if precision == "fp16":  # dynamic scale from 2^18: the first steps overflow and are skipped
        section |= {"loss_scale": 0, "initial_scale_power": 18}
    config[precision] = section
    return section if precision == "fp16" else None


def _train(stage: int, precision: str, zero: dict[str, Any] | None = None) -> zengine.Engine:
    """TinyGPT on the GPU, by the engine and by plain PyTorch from the same weights: asserts
    their losses agree, and returns the engine."""
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    reference = copy.deepcopy(model)
    config = engine_config(stage)
    config["zero_optimization"] |= zero or {}
    fp16 = _precision(config, precision)
    engine, *_ = zengine.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.device == torch.device("cuda", torch.cuda.current_device())
    data = [tokens.cuda() for tokens in global_batches(STEPS, 2)]
    losses = []
    for tokens in data:
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if precision == "fp32":
        expected = plain_losses(reference, data, lr=config["optimizer"]["params"]["lr"])
    else:
        expected, _ = mixed_precision_losses(reference, data, DTYPES[precision], fp16=fp16)
    tolerance = TOLERANCE[precision]
    torch.testing.assert_close(losses, expected, rtol=tolerance, atol=0)
    # fp16: the scale came down through overflows, skipped as the reference skipped them
    assert (engine.skipped_steps > 0) if precision == "fp16" else engine.skipped_steps == 0
    return engine


def _on(engine: zengine.Engine, state: str) -> set[str]:
    """Where the engine holds bytes of `state` (an offload_states type) now."""
    return {where for where, nbytes in engine.memory_held()[state].items() if nbytes}


class TestEngineOnCuda(DistributedTest):
    world_size = 1

    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    @pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
    def test_stage_and_precision_train_as_plain_pytorch(self, stage: int, precision: str) -> None:
        engine = _train(stage, precision)
        device = f"cuda:{torch.cuda.current_device()}"
        assert _on(engine, "optim_states") == {device}
        assert _on(engine, "lp_params") == {device}

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_offload_optimizer_to_cpu(self, stage: int) -> None:
        engine = _train(stage, "bf16", {"offload_optimizer": {"device": "cpu", "pin_memory": True}})
        assert _on(engine, "optim_states") == {"cpu"}  # the step runs on the host
        assert _on(engine, "hp_params") == {"cpu"}

    @pytest.mark.parametrize("param", ["none", "cpu"])
    def test_offload_param_and_optimizer_to_cpu(self, param: str) -> None:
        zero = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": param}}
        engine = _train(3, "bf16", zero)
        assert _on(engine, "optim_states") == {"cpu"}
        device = f"cuda:{torch.cuda.current_device()}"
        assert _on(engine, "lp_params") == ({"cpu"} if param == "cpu" else {device})

    @pytest.mark.parametrize("param", ["none", "nvme"])
    def test_offload_to_nvme(self, param: str) -> None:
        with tempfile.TemporaryDirectory(prefix="zengine-gpu-nvme-") as folder:
            offload = {"device": "nvme", "nvme_path": folder}
            zero = {"offload_optimizer": offload, "offload_param": offload | {"device": param}}
            engine = _train(3, "bf16", zero)
            # between steps the masters and Adam's moments are in their files, not here
            assert not _on(engine, "optim_states") - {"cpu"}
            if param == "nvme":  # and every released bf16 shard in its own
                assert not _on(engine, "lp_params") - {"cpu"}
