"""DeepSpeed's checkpoints continued on zstack: how close zstack's continuation comes to
DeepSpeed's own, against how close the two engines are from the same start.

Run by ``nox -s bench -- deepspeed_resume`` (or ``python bench/bench_deepspeed_resume.py``).
The checkpoints are zengine's test fixtures (packages/zengine/tests/deepspeed_checkpoints/),
written by DeepSpeed 0.19.8 with the script kept there, with the losses DeepSpeed trained: 3
steps before the save, 3 after it. For each case zstack trains the same model from the same
start for 6 steps ("engines apart": the largest difference from DeepSpeed's losses over steps
4-6), then a fresh engine loads DeepSpeed's checkpoint and trains steps 4-6 ("loaded": the
largest difference from DeepSpeed's continuation). Losses are each step's mean over the ranks,
of a global batch of 8 whatever the world size.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

import zengine
from _common import ds_fixture, run_ranks

fx: Any = ds_fixture()

# (case, the world size zstack loads it at, the ZeRO stage it runs, or None for the case's)
RUNS: list[tuple[str, int, int | None]] = [
    *[(case, world, None) for case, (_, _, world, _) in sorted(fx.CASES.items())],
    ("stage3_fp32_ws2", 1, None),
    ("stage3_fp32_ws2", 4, None),
    ("stage2_fp32_ws4", 2, None),
    ("stage1_bf16_ws2", 4, None),
    ("stage3_fp16_ws2", 1, None),
    ("stage3_fp32_ws2", 2, 1),
    ("stage3_fp32_ws2", 4, 0),
]


def _train(engine: Any, data: list[torch.Tensor]) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for tokens in data:
        loss = engine(fx.local(tokens, rank, world))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().reshape(1).clone()
        dist.all_reduce(mean)
        out.append(mean.item() / world)
    return out


def _engine(config: dict[str, Any]) -> Any:
    m = fx.model()
    engine, *_ = zengine.initialize(model=m, model_parameters=fx.param_groups(m), config=config)
    return engine


def worker() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = []
    data = fx.batches(fx.STEPS_BEFORE + fx.STEPS_AFTER)
    for case, at, stage in RUNS:
        if at != world:
            continue
        config = fx.config(case, world)
        if stage is not None:
            config["zero_optimization"]["stage"] = stage
        recorded = fx.losses(case)
        fresh = _train(_engine(config), data)[fx.STEPS_BEFORE :]
        loaded = _engine(config)
        loaded.load_checkpoint(fx.FIXTURES / case)
        after = _train(loaded, data[fx.STEPS_BEFORE :])

        def gap(ours: list[float], recorded: list[float] = recorded["after"]) -> float:
            return max(abs(a - b) for a, b in zip(ours, recorded, strict=True))

        results.append({"case": case, "world": world, "stage": stage, "apart": gap(fresh)})
        results[-1]["loaded"] = gap(after)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> None:
    rows: list[dict[str, Any]] = []
    for world in sorted({at for _, at, _ in RUNS}):
        found: Any = run_ranks(__file__, ["worker"], world)[0]
        rows.extend(found)
    print(
        "### DeepSpeed 0.19.8's checkpoints continued on zstack: largest |loss - DeepSpeed's| "
        "over the 3 steps after the save\n"
    )
    print("| DeepSpeed's checkpoint | zstack loads at | engines apart (same start) | loaded |")
    print("|---|---|---:|---:|")
    for row in rows:
        stage = f", ZeRO stage {row['stage']}" if row["stage"] is not None else ""
        print(
            f"| {row['case']} | {row['world']} ranks{stage} | {row['apart']:.2e} "
            f"| {row['loaded']:.2e} |"
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        worker()
    else:
        main()
