"""What the benchmarks share: the GPT they train, a training step of a model and optimizer or of
an engine, and starting ranks as separate processes."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and an MLP, each residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            y.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for y in self.qkv(self.ln1(x)).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class GPT(nn.Module):
    """Embeddings, `blocks` blocks, final LayerNorm and head; forward returns the mean loss."""

    def __init__(self, *, vocab: int, hidden: int, seq: int, heads: int, blocks: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        loss: torch.Tensor = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss


Batch = tuple[torch.Tensor, torch.Tensor]
Step = Callable[[Batch], torch.Tensor]


def trainer_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Step:
    """A step of plain PyTorch: forward (the model returns the loss), backward, step, zero."""

    def step(batch: Batch) -> torch.Tensor:
        loss: torch.Tensor = model(*batch)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def engine_step(engine: Any) -> Step:
    """A step of a zengine or DeepSpeed engine (Any: DeepSpeed ships no type information)."""

    def step(batch: Batch) -> torch.Tensor:
        loss: torch.Tensor = engine(*batch)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """This environment, plus what torchrun would set for `rank` of `world`."""
    return dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def run_ranks(script: str, args: Sequence[str], world: int) -> list[dict[str, object]]:
    """Run `script` with `args` as `world` ranks and return, in rank order, what those that
    report printed after ``RESULT `` (one JSON line each)."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, script, *args],
            env=rank_env(rank, world, port),
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a benchmark rank failed: exit codes {[p.returncode for p in procs]}")
    results = [
        json.loads(line.removeprefix("RESULT "))
        for out in outputs
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]
    if not results:
        raise SystemExit("no benchmark rank printed a RESULT line")
    return results


def ds_fixture() -> Any:
    """zengine's tests' DeepSpeed fixture module (model, data, configs), loaded by its path
    (Any: a module of the checkout's tests, which no environment installs)."""
    path = Path(__file__).resolve().parents[1] / "packages/zengine/tests/_ds_fixture.py"
    spec = importlib.util.spec_from_file_location("_ds_fixture", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
