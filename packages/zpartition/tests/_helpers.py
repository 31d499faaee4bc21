"""What zpartition's tests share: small models and their data, a trainer over partitioned
parameters, and the reference trainer without partitioning that it is compared with."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HIDDEN, VOCAB, SEQ = 16, 32, 6
HEADER = 80  # bytes of one rank's agreement header, 10 int64 words ([Note: agreement])
# TinyGPT's units gathered again for every use: a unit per module (named by its module), the
# norms and the bias persistent (gathered exactly), every other unit released after each use
# so the backward gathers it again, and a prefetch bucket of two units at most (batched gathers)
REGATHERED: dict[str, Any] = {
    "module_group_size": 0,
    "param_persistence_threshold": 48,
    "max_reuse_distance": 0,
    "prefetch_bucket_size": 1600,
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.act = nn.GELU()
        self.down = nn.Linear(3 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class TinyGPT(nn.Module):
    """Embedding, blocks, and a head tied to the embedding (read through its attribute)."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(HIDDEN)
        self.bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.embed.weight.t() + self.bias
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), tokens.roll(1, dims=1).flatten()
        )


def batches(steps: int, batch: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(steps)]


def train_partitioned(
    model: nn.Module,
    shards: list[torch.Tensor],
    data: list[Any],
    lr: float,
    loss_of: Callable[[Any], torch.Tensor] | None = None,
    *,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
    accumulation: int = 1,
    handle: Any = None,
    hold_until_boundary: bool = False,
) -> list[float]:
    """Each rank trains on its slice of every global batch, with `optimizer` over its `shards`;
    returns the global mean losses (what `reference_losses` gives for the whole batches).
    `loss_of(item)`: this rank's loss for an item of `data` (default: the model on its slice).
    `accumulation`: the slice in that many micro-batches, one step after them; with the
    `handle` of a hybrid-sharded model, gradients are all-reduced across the replicas in the
    last micro-batch's backward only (``set_requires_all_reduce``); with `hold_until_boundary`,
    the handle's earlier backward passes reduce nothing (``set_requires_gradient_sync``)."""
    import zcomm  # the reference trainer below runs without a world

    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    opt = optimizer(shards, lr=lr)
    losses = []
    for item in data:
        total: torch.Tensor | None = None
        for i in range(accumulation):
            if handle is not None:
                handle.set_requires_all_reduce(i == accumulation - 1)
                if hold_until_boundary:
                    handle.set_requires_gradient_sync(i == accumulation - 1)
            if loss_of is None:
                loss = model(item.chunk(world)[rank].chunk(accumulation)[i]) / accumulation
            else:
                loss = loss_of(item)
            loss.backward()
            part = loss.detach().clone()
            total = part if total is None else total + part
        assert total is not None
        opt.step()
        opt.zero_grad()
        zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)
        losses.append(total.item())
    return losses


def reference_losses(
    model: nn.Module,
    data: list[Any],
    lr: float,
    loss_of: Callable[[Any], torch.Tensor] | None = None,
    *,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.SGD,
) -> list[float]:
    """Plain `optimizer` on whole batches; `loss_of(item)` as `train_partitioned`'s, on a whole
    item."""
    opt = optimizer(model.parameters(), lr=lr)
    losses = []
    for item in data:
        loss = model(item) if loss_of is None else loss_of(item)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def hybrid_groups(shard: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's shard group and replicate group in a grid of the world: shard groups of
    `shard` consecutive ranks; a replicate group is the ranks with one index in every shard
    group (world 4, shard 2: shard groups [0, 1], [2, 3], replicate groups [0, 2], [1, 3])."""
    import zcomm

    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    shards = groups([list(range(s, s + shard)) for s in range(0, world, shard)])
    replicas = groups([list(range(i, world, shard)) for i in range(shard)])
    return shards[rank // shard], replicas[rank % shard]


def groups(lists: list[list[int]]) -> list[dist.ProcessGroup]:
    """One group per rank list, made by every rank in list order (as torch requires)."""
    import zcomm

    return [zcomm.new_group(ranks) for ranks in lists]


def externals(module: nn.Module) -> dict[int, Any]:
    """``module._external_params`` (typed: nn.Module's __getattr__ hides it from mypy)."""
    found: dict[int, Any] = module.__dict__.get("_external_params", {})
    return found


@contextlib.contextmanager
def nodes_of(ranks_per_node: int) -> Iterator[None]:
    """The world as nodes of `ranks_per_node` consecutive ranks inside (``zcomm.set_node_layout``:
    4 processes as 2 nodes of 2), one node again after, as a world without a launcher is."""
    import zcomm

    zcomm.set_node_layout(ranks_per_node)
    try:
        yield
    finally:
        zcomm.set_node_layout(zcomm.get_world_size())


def link_bytes(run: Callable[[], object]) -> dict[str, tuple[int, int]]:
    """The bytes `run()` communicated, per operation: (within a node, across nodes)."""
    import zcomm

    zcomm.enable_comm_accounting()
    zcomm.reset_comm_accounting()
    try:
        run()
        summary = zcomm.comm_summary()
    finally:
        zcomm.enable_comm_accounting(False)
    return {op: (s.intra_node_bytes, s.inter_node_bytes) for op, s in summary.items()}


def window_bytes(
    model: nn.Module, micro: list[torch.Tensor], require: Callable[[bool], object]
) -> tuple[list[dict[str, tuple[int, int]]], dict[str, tuple[int, int]]]:
    """`link_bytes` of a backward of `model` on each of `micro`, the last one after
    ``require(True)`` (the accumulation's boundary), the others after ``require(False)``."""

    def backward(tokens: torch.Tensor) -> None:
        model(tokens).backward()

    require(False)
    inside = [link_bytes(functools.partial(backward, t)) for t in micro[:-1]]
    require(True)
    return inside, link_bytes(lambda: backward(micro[-1]))


def pass_bytes(model: nn.Module, tokens: torch.Tensor) -> list[dict[str, tuple[int, int]]]:
    """`link_bytes` of the forward of `model` on `tokens` (its loss), then of its backward."""
    losses: list[torch.Tensor] = []
    forward = link_bytes(lambda: losses.append(model(tokens)))
    return [forward, link_bytes(lambda: losses[0].backward())]


def rank_grads(model: nn.Module, data: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient summed over `data` and every rank's slice of each item (the
    ranks' losses as `train_partitioned` cuts them), computed in one process."""
    import zcomm

    world = zcomm.get_world_size()
    found: dict[str, torch.Tensor] = {}
    for tokens in data:
        for part in tokens.chunk(world):
            model.zero_grad()
            model(part).backward()
            for n, p in model.named_parameters():
                assert p.grad is not None
                found[n] = found.get(n, torch.zeros_like(p)) + p.grad
    return found


def same_on_every_rank(t: torch.Tensor) -> bool:
    """Whether every rank holds exactly `t` (NaN-free tensors)."""
    high, low = t.clone(), t.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return torch.equal(high, low) and torch.equal(high, t)
