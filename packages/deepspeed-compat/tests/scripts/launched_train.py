"""A DeepSpeed user's training script, started by the ``deepspeed`` launcher in
test_launcher.py (``deepspeed --num_gpus 2 launched_train.py --deepspeed ds.json --out DIR``).

It parses its arguments as Transformers' example scripts do (``--local_rank`` from the
launcher, ``--deepspeed`` the config's path), trains a small model two steps through
``deepspeed.initialize`` over gloo and writes what it saw to ``DIR/rank{RANK}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--deepspeed", required=True, help="the DeepSpeed config file")
parser.add_argument("--out", required=True)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
engine, *_ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=args.deepspeed
)
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
losses = []
for step in range(2):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
result = {
    "rank": rank,
    "world": world,
    "local_rank_arg": args.local_rank,
    "local_rank_env": int(os.environ["LOCAL_RANK"]),
    "deepspeed_arg": args.deepspeed,
    "argv": sys.argv[1:],
    "losses": losses,
    "global_steps": engine.global_steps,
    "cross_rank": os.environ.get("CROSS_RANK"),
    "cross_size": os.environ.get("CROSS_SIZE"),
    "group_rank": os.environ.get("GROUP_RANK"),
    "from_env_file": os.environ.get("ZSTACK_LAUNCH_TEST"),
}
Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
