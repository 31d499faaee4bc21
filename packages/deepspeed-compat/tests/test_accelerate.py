"""An Accelerate loop with a DeepSpeed plugin on zstack (``prepare``, ``accumulate``,
``backward``, ``clip_grad_norm_``, ``step``, ``save_state``/``load_state``,
``get_state_dict``, ``unwrap_model``), under ``torchrun`` with 2 ranks, against the same loop
without DeepSpeed (DDP on gloo). One launch runs every scenario (scripts/accelerate_loop.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _helpers import save_tiny_model, torchrun

STAGES = ["zero2", "zero3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("accelerate")
    model_dir = save_tiny_model(run_dir / "model")
    return torchrun("accelerate_loop.py", str(run_dir), str(model_dir))


@pytest.mark.parametrize("name", STAGES)
def test_losses_equal_the_loop_without_deepspeed(runs: dict[str, Any], name: str) -> None:
    assert runs[name]["distributed_type"] == "DistributedType.DEEPSPEED"
    assert runs[name]["world"] == runs["ddp"]["world"] == 2
    assert runs[name]["losses"] == pytest.approx(runs["ddp"]["losses"], rel=1e-5, abs=0)
    assert len(set(runs["ddp"]["losses"])) == len(runs["ddp"]["losses"])  # training moved


@pytest.mark.parametrize("name", ["ddp", *STAGES])
def test_load_state_resumes_bit_exactly(runs: dict[str, Any], name: str) -> None:
    """``save_state`` after step 3, ``load_state`` into a fresh run: steps 4-6 repeat."""
    resumed = runs[name]["resumed_losses"]
    assert resumed == runs[name]["losses"][-len(resumed) :]


@pytest.mark.parametrize("name", STAGES)
def test_get_state_dict_and_unwrap_model(runs: dict[str, Any], name: str) -> None:
    """``get_state_dict`` gives the whole trained weights (at ZeRO-3 gathered from the shards),
    equal to the loop without DeepSpeed's; ``unwrap_model`` gives the Transformers model.

    The weights moved by about 0.02 in training and agree to about 2e-6: the gradients are
    summed in another order (a reduce-scatter against DDP's all-reduce), and Adam, which divides
    by the root of the squared gradients, shows last-bit differences of tiny gradients."""
    assert runs[name]["unwrapped"] == "LlamaForCausalLM"
    found = torch.load(runs[name]["state_dict"])
    expected = torch.load(runs["ddp"]["state_dict"])
    assert found.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(found[key], value, rtol=1e-4, atol=1e-5, msg=key)
