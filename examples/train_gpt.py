"""Train a small GPT with ZeRO-3 through zengine: DeepSpeed's config and training loop.

    torchrun --nproc-per-node=2 examples/train_gpt.py     # 2 ranks: gloo on CPU, NCCL on GPU
    python examples/train_gpt.py --text README.md          # a world of one, on a text file

Bytes are the tokens (vocabulary 256). By default the data is synthetic and learnable: each
sequence strings together words drawn from a fixed set of random 8-byte words, so once a word
has begun the rest of it is predictable, and the loss falls from ln 256 = 5.5 towards
ln(16) / 8 = 0.35 within a hundred steps. With ``--text`` it is random windows of the file.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zcomm
import zengine

VOCAB, SEQ, HIDDEN, HEADS, BLOCKS = 256, 64, 128, 4, 4
MICRO_BATCH, ACCUMULATION, LR = 8, 2, 3e-3
WORDS, WORD_LEN = 16, 8
Batch = tuple[torch.Tensor, torch.Tensor]


def ds_config(stage: int, bf16: bool) -> dict[str, Any]:
    """A DeepSpeed config, unchanged: zengine reads the same keys."""
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "steps_per_print": 10,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 10},
        },
        "bf16": {"enabled": bf16},
        # small enough that every Linear and Embedding weight is partitioned across the ranks
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000},
    }


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(
            nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            y.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            for y in self.qkv(self.ln1(x)).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Token and position embeddings, the blocks, a head; forward returns the mean loss."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))
        self.ln, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batches(text: Path | None, seed: int, rank: int, device: torch.device) -> Iterator[Batch]:
    """Endless (inputs, targets) micro-batches, different on every rank."""
    gen = torch.Generator().manual_seed(seed)
    if text is None:
        words = torch.randint(0, VOCAB, (WORDS, WORD_LEN), generator=gen)  # the same on all ranks
    else:
        raw = text.read_bytes()
        if len(raw) <= SEQ + 1:
            raise SystemExit(f"--text {text}: needs more than {SEQ + 1} bytes, has {len(raw)}")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    gen.manual_seed(seed * 1000 + rank + 1)
    while True:
        if text is None:
            picks = torch.randint(0, WORDS, (MICRO_BATCH, SEQ // WORD_LEN + 1), generator=gen)
            seqs = words[picks].flatten(1)[:, : SEQ + 1]
        else:
            starts = torch.randint(0, len(data) - SEQ - 1, (MICRO_BATCH, 1), generator=gen)
            seqs = data[starts + torch.arange(SEQ + 1)]
        yield seqs[:, :-1].to(device), seqs[:, 1:].to(device)


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--text", type=Path, help="train on this file's bytes, not synthetic data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    start = time.perf_counter()
    zcomm.init_distributed()  # torchrun's environment, or a world of one
    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    config = ds_config(args.stage, bf16=torch.cuda.is_available())
    torch.manual_seed(args.seed)
    with zengine.zero.Init(config_dict_or_path=config, enabled=args.stage == 3):
        model = GPT()  # built partitioned: no rank ever holds the whole model
    engine, _, _, _ = zengine.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    if rank == 0:
        print(
            f"GPT: {BLOCKS} blocks, hidden {HIDDEN}, {n_params / 1e6:.2f} M parameters; "
            f"ZeRO stage {args.stage} on {world} rank(s), {engine.device}; "
            f"{engine.train_batch_size()} sequences of {SEQ} bytes per step; "
            f"data: {args.text or 'synthetic words'}",
            flush=True,
        )

    data = batches(args.text, args.seed, rank, engine.device)
    curve = torch.zeros(args.steps, device=engine.device)  # the loss of each optimizer step
    train_start = time.perf_counter()
    while engine.global_steps < args.steps:
        step = engine.global_steps
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(*next(data))
            engine.backward(loss)
            engine.step()  # steps the optimizer at the accumulation boundary only
            curve[step] += loss.detach().float() / engine.gradient_accumulation_steps()
    train_time = time.perf_counter() - train_start

    zcomm.all_reduce(curve)  # the mean over the ranks
    curve = curve.cpu() / world
    memory = torch.zeros(world, 2, dtype=torch.float64, device=engine.device)
    # the engine's own account: shards, masters, gradient partitions, optimizer state
    held = sum(engine.memory_held()["total"].values())
    memory[rank] = torch.tensor([held, peak_rss_bytes()])
    zcomm.all_reduce(memory)  # every rank's figures, on every rank
    if rank == 0:
        tail = min(10, len(curve))
        first, last = curve[0].item(), curve[-tail:].mean().item()
        samples = engine.train_batch_size() * args.steps
        print(
            f"loss: first {first:.3f}, last {last:.3f} (mean of the last {tail} steps): "
            f"{'went down' if last < first else 'did NOT go down'} ({last / first - 1:+.0%})"
        )
        states, rss = (" / ".join(f"{x / 2**20:.1f}" for x in col) for col in memory.T.tolist())
        print(f"per rank (rank 0 / 1 / ...): model states {states} MiB, peak RSS {rss} MiB")
        print(
            f"throughput: {samples / train_time:.1f} samples/s, "
            f"{samples * SEQ / train_time:.0f} tokens/s; "
            f"wall time {time.perf_counter() - start:.1f} s ({train_time:.1f} s training)"
        )
    engine.destroy()
    zcomm.destroy()


if __name__ == "__main__":
    main()
