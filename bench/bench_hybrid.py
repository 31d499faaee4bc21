"""Bytes per rank per optimizer step within a node and across nodes: plain ZeRO-3 against hybrid
sharding (``mics_shard_size``), the demo's GPT on 4 ranks as 2 nodes x 2, accumulation 4.

Run by ``nox -s bench -- hybrid`` (or ``python bench/bench_hybrid.py``); prints markdown. The
4 processes share one machine: the nodes are zcomm's `set_node_layout(2)`, and the bytes are
zcomm's accounting by link class (a collective whose group spans nodes counts as crossing
them; [Note: ...] in zcomm/_accounting.py), so the figures are exact whatever the machine.
Each variant trains STEPS optimizer steps from the same weights on the same data; the losses
are compared with plain ZeRO-3's. Every variant releases a unit after its forward
(``stage3_max_reuse_distance`` 0, FSDP2's ``reshard_after_forward=True``, and a prefetch
bucket and live-parameter limit of about one block, where DeepSpeed's defaults would hold the
whole demo), as a model that does not fit must: the backward gathers again, which is what hpZ
keeps inside the node. The "coalesce_grad_reduction" variants run each step's micro-batches
inside ``engine.coalesce_grad_reduction()``: their gradients stay whole on each rank and cross
the ranks once, as the block is left.
"node-local accumulation" (``node_local_accumulation``) reduce-scatters each micro-batch's
gradients within the node and across the nodes once per step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from _common import run_ranks

ROOT = Path(__file__).resolve().parent.parent
STEPS, ACCUMULATION, WORLD, PER_NODE = 4, 4, 4, 2
PREFETCH = 200_000  # elements, about one of the demo's blocks (12 x 128^2)
# name: (mics_shard_size, zero_hpz_partition_size, node_local_accumulation, gradients held
# until one reduction by coalesce_grad_reduction)
VARIANTS: dict[str, tuple[int | str, int, bool, bool]] = {
    "plain ZeRO-3": (-1, 1, False, False),
    "hybrid, shard within a node (mics_shard_size)": ("node", 1, False, False),
    "hpZ (zero_hpz_partition_size 2)": (-1, 2, False, False),
    "node-local accumulation": (-1, 1, True, False),
    "hpZ + node-local accumulation": (-1, 2, True, False),
    "plain ZeRO-3, coalesce_grad_reduction": (-1, 1, False, True),
    "hpZ, coalesce_grad_reduction": (-1, 2, False, True),
}


def _train_gpt() -> Any:
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_args(setting: tuple[int | str, int, bool, bool], *, release: bool = True) -> list[str]:
    """The command line of `_worker` for a variant's setting; `release` False keeps
    DeepSpeed's prefetch and reuse defaults (the whole demo stays gathered into the
    backward), as bench_projection's check models it."""
    size, hpz, node_local, hold = setting
    return [
        "--worker",
        str(size),
        str(hpz),
        str(int(node_local)),
        str(int(hold)),
        str(int(release)),
    ]


def _worker(shard_size: str, hpz: int, node_local: bool, hold: bool, release: bool) -> None:
    import json

    import zcomm
    import zengine

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    zcomm.set_node_layout(PER_NODE)
    train_gpt = _train_gpt()
    torch.manual_seed(0)
    config = train_gpt.ds_config(3, bf16=False)
    # held: the user's micro-batches in one engine step, as DeepSpeed's coalescing tests run
    config |= {"gradient_accumulation_steps": 1 if hold else ACCUMULATION}
    config |= {"steps_per_print": 10**6}
    size: int | str = shard_size if shard_size == "node" else int(shard_size)
    config["zero_optimization"] = dict(
        config["zero_optimization"],
        mics_shard_size=size,
        zero_hpz_partition_size=hpz,
        node_local_accumulation=node_local,
    )
    if release:
        config["zero_optimization"] |= {
            "stage3_max_reuse_distance": 0,
            # scaled to the demo as DeepSpeed's defaults (5e7 and 1e9 elements) are to a model
            # of billions: a bucket prefetches a block ahead, not the whole model and backward
            "stage3_prefetch_bucket_size": PREFETCH,
            "stage3_max_live_parameters": 2 * PREFETCH,
        }
    engine, *_ = zengine.initialize(model=train_gpt.GPT(), config=config)
    rank = torch.distributed.get_rank()
    data = train_gpt.batches(None, 0, rank, torch.device("cpu"))
    zcomm.enable_comm_accounting()
    losses, steps = [], []
    for _ in range(STEPS):
        zcomm.reset_comm_accounting()
        total = 0.0
        with engine.coalesce_grad_reduction() if hold else contextlib.nullcontext():
            for k in range(ACCUMULATION):
                loss = engine(*next(data))
                if hold:
                    engine.set_gradient_accumulation_boundary(k == ACCUMULATION - 1)
                engine.backward(loss / ACCUMULATION if hold else loss)
                if not hold:
                    engine.step()
                total += float(loss.detach())
        if hold:
            engine.step()
        steps.append(zcomm.comm_bytes_by_link())
        mean = torch.tensor(total / ACCUMULATION)
        zcomm.enable_comm_accounting(False)  # the reported loss's all-reduce is not training's
        torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
        zcomm.enable_comm_accounting()
        losses.append(float(mean))
    result = {
        "rank": rank,
        "losses": losses,
        "inter": statistics.median(s["inter_node"] for s in steps),
        "intra": statistics.median(s["intra_node"] for s in steps),
    }
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    rows, plain_losses = [], None
    for name, setting in VARIANTS.items():
        ranks = run_ranks(__file__, worker_args(setting), world=WORLD)
        inter = statistics.median(float(r["inter"]) for r in ranks)  # type: ignore[arg-type]
        intra = statistics.median(float(r["intra"]) for r in ranks)  # type: ignore[arg-type]
        losses = ranks[0]["losses"]
        assert isinstance(losses, list)
        if plain_losses is None:
            plain_losses = losses
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, plain_losses, strict=True))
        rows.append((name, inter, intra, diff))
    base = rows[0][1]
    print(
        f"demo GPT (fp32), {WORLD} ranks as {WORLD // PER_NODE} nodes x {PER_NODE}, "
        f"accumulation {ACCUMULATION}; bytes per rank per optimizer step (median of {STEPS})\n"
    )
    print("| variant | across nodes | ratio to plain | within a node | losses vs plain (max rel) |")
    print("|---|---|---|---|---|")
    for name, inter, intra, diff in rows:
        print(
            f"| {name} | {inter / 2**20:.2f} MiB | {inter / base:.3f}x | "
            f"{intra / 2**20:.2f} MiB | {diff:.1e} |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 6 and sys.argv[1] == "--worker":
        size, hpz, *flags = sys.argv[2:7]
        _worker(size, int(hpz), *(bool(int(f)) for f in flags))
    else:
        main()
