"""Writes the fixture checkpoints with the real DeepSpeed; nothing of zstack is imported.

Run in an environment with DeepSpeed from PyPI (``pip install deepspeed==0.19.8``), once per
world size, from this folder::

    torchrun --nproc-per-node 2 make.py
    torchrun --nproc-per-node 4 make.py

Each case of `_ds_fixture.CASES` (and of `PIPE_CASES`, DeepSpeed's pipeline engine) at this
world size trains `STEPS_BEFORE` steps, saves
``fixtures/<case>/`` with ``engine.save_checkpoint``, trains `STEPS_AFTER` more, and then a fresh
engine loads the checkpoint and trains the same steps again. ``losses.json`` records the losses
(each step's mean over the ranks) of all three runs and DeepSpeed's version. Cases listed in
`UNIVERSAL` are also converted with DeepSpeed's ``ds_to_universal``. The scripts DeepSpeed copies
into a checkpoint folder (``zero_to_fp32.py``) are DeepSpeed's code, not ours: they are removed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

import deepspeed
from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.checkpoint.ds_to_universal import (
    main as ds_to_universal,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _ds_fixture as fixture  # type: ignore[import-not-found]

UNIVERSAL = ("stage2_fp32_ws2", "stage3_fp32_ws2", "stage3_bf16_ws2")
TAG = f"global_step{fixture.STEPS_BEFORE}"


def engine(case: str) -> Any:
    m = fixture.model()
    eng, *_ = deepspeed.initialize(
        model=m, model_parameters=fixture.param_groups(m), config=fixture.config(case)
    )
    return eng


def train(eng: Any, data: list[torch.Tensor]) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for tokens in data:
        loss = eng(fixture.local(tokens, rank, world).to(eng.device))
        eng.backward(loss)
        eng.step()
        mean = loss.detach().float().reshape(1).clone()
        dist.all_reduce(mean)
        out.append(mean.item() / world)
    return out


def make(case: str) -> None:
    folder = fixture.FIXTURES / case
    data = fixture.batches(fixture.STEPS_BEFORE + fixture.STEPS_AFTER)
    before, after = data[: fixture.STEPS_BEFORE], data[fixture.STEPS_BEFORE :]
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    eng = engine(case)
    losses_before = train(eng, before)
    client = {"epoch": 1, "note": "written by DeepSpeed", UNIVERSAL_CHECKPOINT_INFO: {}}
    eng.save_checkpoint(str(folder), client_state=client)
    straight = train(eng, after)
    eng.destroy()
    resumed_engine = engine(case)
    resumed_engine.load_checkpoint(str(folder))
    resumed = train(resumed_engine, after)
    resumed_engine.destroy()
    dist.barrier()
    if dist.get_rank() == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (folder / script).unlink(missing_ok=True)
        if case in UNIVERSAL:
            ds_to_universal(
                SimpleNamespace(
                    input_folder=str(folder / TAG),
                    output_folder=str(folder / f"{TAG}_universal"),
                    num_extract_workers=1,
                    num_merge_workers=1,
                    keep_temp_folder=False,
                    strict=True,
                    inject_missing_state=False,
                )
            )
        record = {
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "world_size": dist.get_world_size(),
            "before": losses_before,
            "after": straight,
            "resumed": resumed,
        }
        (folder / "losses.json").write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()


def pipe_engine(case: str) -> Any:
    from deepspeed.pipe import (
        LayerSpec,
        PipelineModule,
        TiedLayerSpec,
    )

    _, stages, _ = fixture.PIPE_CASES[case]
    module = PipelineModule(
        layers=fixture.pipe_specs(LayerSpec, TiedLayerSpec),
        num_stages=stages,
        loss_fn=fixture.pipe_loss,
        seed_layers=True,
        base_seed=fixture.PIPE_BASE_SEED,
        partition_method="uniform",
    )
    config = fixture.pipe_config(case)
    parameters = module.parameters()
    eng, *_ = deepspeed.initialize(model=module, model_parameters=parameters, config=config)
    return eng


def pipe_train(eng: Any, data: list[torch.Tensor]) -> list[float]:
    accumulation = eng.gradient_accumulation_steps()
    dp, rank = eng.grid.get_data_parallel_world_size(), eng.grid.get_data_parallel_rank()
    return [
        eng.train_batch(iter(fixture.pipe_micro_batches(t, accumulation, dp, rank))).item()
        for t in data
    ]


def make_pipe(case: str) -> None:
    """`make` for a pipeline case (no universal conversion: DeepSpeed's needs Megatron's
    layer metadata)."""
    folder = fixture.FIXTURES / case
    data = fixture.batches(fixture.STEPS_BEFORE + fixture.STEPS_AFTER)
    before, after = data[: fixture.STEPS_BEFORE], data[fixture.STEPS_BEFORE :]
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    eng = pipe_engine(case)
    losses_before = pipe_train(eng, before)
    eng.save_checkpoint(str(folder), client_state={"epoch": 1, "note": "written by DeepSpeed"})
    straight = pipe_train(eng, after)
    resumed_engine = pipe_engine(case)
    resumed_engine.load_checkpoint(str(folder))
    resumed = pipe_train(resumed_engine, after)
    dist.barrier()
    if dist.get_rank() == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (folder / script).unlink(missing_ok=True)
        record = {
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "world_size": dist.get_world_size(),
            "before": losses_before,
            "after": straight,
            "resumed": resumed,
        }
        (folder / "losses.json").write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    chosen = sys.argv[1:]
    for case, (_, _, case_world, _) in fixture.CASES.items():
        if case_world == world and (not chosen or case in chosen):
            make(case)
    for case, (_, stages, dp) in fixture.PIPE_CASES.items():
        if stages * dp == world and (not chosen or case in chosen):
            make_pipe(case)


if __name__ == "__main__":
    main()
