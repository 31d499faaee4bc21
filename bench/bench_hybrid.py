"""Bytes per rank per optimizer step within a node and across nodes: plain ZeRO-3 against hybrid
sharding (``mics_shard_size``), the demo's GPT on 4 ranks as 2 nodes x 2, accumulation 4.

Run by ``nox -s bench -- hybrid`` (or ``python bench/bench_hybrid.py``); prints markdown. The
4 processes share one machine: the nodes are zcomm's `set_node_layout(2)`, and the bytes are
zcomm's accounting by link class (a collective whose group spans nodes counts as crossing
them; [Note: ...] in zcomm/_accounting.py), so the figures are exact whatever the machine.
Each variant trains STEPS optimizer steps from the same weights on the same data; the losses
are compared with plain ZeRO-3's.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from _common import run_ranks

ROOT = Path(__file__).resolve().parent.parent
STEPS, ACCUMULATION, WORLD, PER_NODE = 4, 4, 4, 2
# name: (mics_shard_size, zero_hpz_partition_size, stage3_max_reuse_distance)
VARIANTS: dict[str, tuple[int | str, int, int]] = {
    "plain ZeRO-3": (-1, 1, 10**9),
    "hybrid, shard within a node": ("node", 1, 10**9),
    "hpZ (zero_hpz_partition_size 2)": (-1, 2, 10**9),
}


def _train_gpt() -> Any:
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _worker(shard_size: str, hpz: int, reuse: int) -> None:
    import json

    import zcomm
    import zengine

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    zcomm.set_node_layout(PER_NODE)
    train_gpt = _train_gpt()
    torch.manual_seed(0)
    config = train_gpt.ds_config(3, bf16=False)
    config |= {"gradient_accumulation_steps": ACCUMULATION, "steps_per_print": 10**6}
    size: int | str = shard_size if shard_size == "node" else int(shard_size)
    config["zero_optimization"] = dict(
        config["zero_optimization"],
        mics_shard_size=size,
        zero_hpz_partition_size=hpz,
        stage3_max_reuse_distance=reuse,
    )
    engine, *_ = zengine.initialize(model=train_gpt.GPT(), config=config)
    rank = torch.distributed.get_rank()
    data = train_gpt.batches(None, 0, rank, torch.device("cpu"))
    zcomm.enable_comm_accounting()
    losses, steps = [], []
    for _ in range(STEPS):
        zcomm.reset_comm_accounting()
        total = 0.0
        for _ in range(ACCUMULATION):
            loss = engine(*next(data))
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
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
    for name, (size, hpz, reuse) in VARIANTS.items():
        ranks = run_ranks(__file__, ["--worker", str(size), str(hpz), str(reuse)], world=WORLD)
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
    if len(sys.argv) > 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
