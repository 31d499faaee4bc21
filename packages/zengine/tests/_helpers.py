"""What the engine's tests share, in one place: a small GPT and its data, the single-process
PyTorch runs they are compared with, and the engine, checkpoint and pipeline set-ups that more
than one test file trains with. ``_restart_job.py`` (a torchrun script) imports it by path.

Sections: the model and the data, with plain PyTorch's fp32 training (`plain_losses`) and
mixed-precision training (`mixed_precision_losses`); the engine (`engine_config`,
`train_engine`, `run_with_plain`); checkpoints (`checkpoint_config`, `checkpoint_engine`,
`train_global`, `file_size_limit`); the pipeline (`pipeline`, `pipe_config`, `pipe_initialize`,
`pipe_train`, `PipeReference`, `pipe_reference_losses`).
"""

from __future__ import annotations

import contextlib
import copy
import resource
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import zcomm
import zengine
from zengine.pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec

VOCAB, HIDDEN, SEQ = 32, 16, 8
LR = 1e-2  # every helper's optimizer: DeepSpeed's "Adam" (AdamW), weight decay 0.01
BASE_SEED = 1234  # the pipeline's per-layer seeds start here

# -- the model and the data ----------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyGPT(nn.Module):
    """Embedding, blocks, head; returns the loss (fp32 logits, next-token cross entropy)."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


def global_batches(steps: int, batch: int, seed: int = 7) -> list[torch.Tensor]:
    """`steps` batches of `batch` token sequences, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(steps)]


def plain_losses(
    model: nn.Module, data: list[torch.Tensor], *, lr: float, clip: float = 0.0
) -> list[float]:
    """What DeepSpeed's "Adam" does (AdamW, weight decay 0.01 here), in one process."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for tokens in data:
        loss = model(tokens)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def mixed_precision_losses(
    model: nn.Module,
    data: list[torch.Tensor],
    dtype: torch.dtype,
    *,
    world: int = 1,
    accumulation: int = 1,
    accumulate_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    fp16: dict[str, Any] | None = None,
    tied: Sequence[tuple[nn.Parameter, nn.Parameter]] = (),
    lr: float = LR,
) -> tuple[list[float], list[torch.Tensor]]:
    """What DeepSpeed's bf16 and fp16 modes compute, in plain PyTorch, one process playing the
    `world` data-parallel ranks in turn. `model` (fp32, left as it is) returns the loss.

    A copy of `model` in `dtype` runs each forward and backward; fp32 masters, the half
    weights widened, are stepped by fused AdamW (DeepSpeed's "Adam", weight decay 0.01) and
    cast back into it. Each rank's micro-batch ``k`` is ``batch.view(accumulation, world, -1,
    seq)[k, rank]``; its loss, times ``scale / accumulation``, is backpropagated and its
    gradients summed over the micro-batches in `accumulate_dtype` (default `dtype`). The two
    copies of each `tied` weight (a pipeline's stages hold one each) then have their sums
    added together; the ranks' gradients are cast to `reduce_dtype` (default `dtype`) and
    averaged in it, rank by rank (a sum, then a division: gloo's average); widened to fp32 and
    divided by the loss scale, they step the masters. fp16: `fp16` is the config's section;
    ``loss_scale`` > 0 is a static scale, 0 DeepSpeed's dynamic one (``initial_scale_power``,
    ``hysteresis``; an inf or NaN gradient skips the step, the raise after
    ``loss_scale_window`` clean steps is left out). Returns each step's loss (the mean of its
    micro-batches' fp32 losses over the ranks) and the masters, in parameter order."""
    half = copy.deepcopy(model).to(dtype)
    params = list(half.parameters())
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ties = [(index[id(a)], index[id(b)]) for a, b in tied]
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=0.01, fused=True)
    section = fp16 or {}
    scale = 1.0
    dynamic, hysteresis = False, 1
    if dtype == torch.float16:
        dynamic = not section.get("loss_scale", 0)
        scale = 2.0 ** section.get("initial_scale_power", 16) if dynamic else section["loss_scale"]
        hysteresis = section.get("hysteresis", 2)
    losses = []
    for batch in data:
        pieces = batch.view(accumulation, world, -1, batch.shape[-1])
        seen: list[torch.Tensor] = []
        ranks: list[list[torch.Tensor]] = []
        for rank in range(world):
            sums = [torch.zeros_like(p, dtype=accumulate_dtype or dtype) for p in params]
            for k in range(accumulation):
                loss = half(pieces[k, rank])
                (loss.float() * (scale / accumulation)).backward()
                seen.append(loss.detach().float())
                for i, p in enumerate(params):
                    assert p.grad is not None
                    sums[i] += p.grad
                    p.grad = None
            for a, b in ties:
                sums[a] = sums[b] = sums[a] + sums[b]
            ranks.append([s.to(reduce_dtype or dtype) for s in sums])
        grads = ranks[0]
        for other in ranks[1:]:
            grads = [g + h for g, h in zip(grads, other, strict=True)]
        if world > 1:
            grads = [g / world for g in grads]
        losses.append(torch.stack(seen).mean().item())
        if not all(bool(g.isfinite().all()) for g in grads):  # skipped; fp16 scales down
            if dynamic and hysteresis == 1:
                scale = max(scale / 2, section.get("min_loss_scale", 1.0))
            elif dynamic:
                hysteresis -= 1
            continue
        for master, grad in zip(masters, grads, strict=True):
            master.grad = grad.float() if scale == 1.0 else grad.float() * (1.0 / scale)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return losses, masters


# uneven: partitions and shards straddle parameters, padding on the last rank
SCALE_SIZES = (7, 5, 3)


class Scale(nn.Module):
    """loss = sum(p * x) over its parameters (of `SCALE_SIZES`, zeros): each parameter's
    gradient is its slice of x, whatever the parameters are."""

    def __init__(self) -> None:
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(n)) for n in SCALE_SIZES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = x.split(list(SCALE_SIZES))
        return sum((p * piece).sum() for p, piece in zip(self.params, pieces, strict=True))


# -- the engine ------------------------------------------------------------------------------


def engine_config(
    stage: int, *, micro: int = 2, accumulation: int = 1, **extra: Any
) -> dict[str, Any]:
    """A DeepSpeed config for TinyGPT at ZeRO `stage`; `extra` keys added or replaced."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16},
        **extra,
    }


def train_engine(engine: zengine.Engine, data: list[torch.Tensor]) -> list[float]:
    """Each global batch split over accumulation steps and ranks; the global mean losses."""
    rank, world = zcomm.get_rank(), zcomm.get_world_size()
    accumulation = engine.gradient_accumulation_steps()
    losses = []
    for tokens in data:
        pieces = tokens.view(accumulation, world, -1, tokens.shape[-1])
        total = torch.zeros(())
        for k in range(accumulation):
            loss = engine(pieces[k, rank])
            share = engine.backward(loss)  # as DeepSpeed's: divided by the accumulation steps
            torch.testing.assert_close(share, loss.detach().float() / accumulation)
            engine.step()
            total += loss.detach().float()
        zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG)
        losses.append(total.item() / accumulation)
    return losses


def run_with_plain(
    stage: int, world: int, steps: int = 10, **config: Any
) -> tuple[list[float], list[float]]:
    """TinyGPT trained by the engine (`engine_config(stage, **config)`) and by `plain_losses`
    on the same global batches, from the same weights: both runs' losses."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    cfg = engine_config(stage, **config)
    engine, *_ = zengine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    batch = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world
    data = global_batches(steps, batch)
    clip = float(cfg.get("gradient_clipping", 0.0))
    return train_engine(engine, data), plain_losses(reference, data, lr=LR, clip=clip)


# -- checkpoints -----------------------------------------------------------------------------


def checkpoint_config(stage: int, **extra: Any) -> dict[str, Any]:
    """`engine_config`'s, with a WarmupLR schedule (a checkpoint must carry its state)."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 16},
        **extra,
    }


def checkpoint_engine(
    stage: int, seed: int = 0, mpu: Any = None, frozen: bool = False, **extra: Any
) -> zengine.Engine:
    """An engine over a TinyGPT seeded with `seed` (its embedding frozen if `frozen`), with
    `checkpoint_config(stage, **extra)`."""
    torch.manual_seed(seed)
    model = TinyGPT()
    model.embed.requires_grad_(not frozen)
    engine, *_ = zengine.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=checkpoint_config(stage, **extra),
        mpu=mpu,
    )
    return engine


def train_global(
    engine: zengine.Engine, data: list[torch.Tensor], group: Any = None
) -> list[float]:
    """Each global batch split over the ranks of `group`; the global mean losses."""
    rank, world = zcomm.get_rank(group), zcomm.get_world_size(group)
    losses = []
    for tokens in data:
        loss = engine(tokens.view(world, -1, tokens.shape[-1])[rank])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        zcomm.all_reduce(total, op=zcomm.ReduceOp.AVG, group=group)
        losses.append(total.item())
    return losses


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """A real write error: files of this process may not grow past `limit` bytes, so a write
    beyond it fails with EFBIG ("File too large"), as a full disk fails with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


# -- the pipeline: an embedding tied to the head, blocks, a norm -------------------------------


def head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The output layer: the embedding's weight, transposed."""
    assert isinstance(embedding, nn.Embedding)
    return x @ embedding.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def specs(blocks: int = 4) -> list[Any]:
    """The pipeline's layers: the tied embedding, `blocks` blocks, a norm, the tied head."""
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN),
        *[LayerSpec(Block) for _ in range(blocks)],
        LayerSpec(nn.LayerNorm, HIDDEN),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=head),
    ]


def pipeline(stages: int, *, chunks: int = 1, blocks: int = 4, **kwargs: Any) -> PipelineModule:
    """The `specs` model in `stages` stages, each layer seeded from `BASE_SEED`."""
    return PipelineModule(
        specs(blocks),
        num_stages=stages,
        loss_fn=loss_fn,
        seed_layers=True,
        base_seed=BASE_SEED,
        chunks=chunks,
        **kwargs,
    )


class PipeReference(nn.Module):
    """The same layers in one process, built with the same per-layer seeds. With `copies`,
    a tied layer's later uses are copies of their own, as the stages hold one each; `tied`
    pairs each copy's weights with the first's (`mixed_precision_losses` sums their
    gradients, as ``ReduceTiedGrads`` does)."""

    def __init__(self, blocks: int = 4, *, copies: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        first: dict[str, nn.Module] = {}
        self.tied: list[tuple[nn.Parameter, nn.Parameter]] = []
        for index, spec in enumerate(specs(blocks)):
            torch.manual_seed(BASE_SEED + index)
            module = spec.build()
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in first:
                    first[spec.key] = module
                elif copies:
                    module = copy.deepcopy(first[spec.key])
                    self.tied += zip(first[spec.key].parameters(), module.parameters(), strict=True)
                else:
                    module = first[spec.key]
                if spec.forward_fn is not None:
                    module = _Applied(module, spec.forward_fn)
            layers.append(module)
        self.layers = nn.ModuleList(layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.layers:
            x = layer(x)
        return x


class _Applied(nn.Module):
    """A tied layer used through its ``forward_fn``."""

    def __init__(self, module: nn.Module, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.module, x)


class WithLoss(nn.Module):
    """A model and the pipeline's loss in one module, as `plain_losses` takes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = loss_fn(self.model(tokens), labels_of(tokens))
        return loss


def labels_of(tokens: torch.Tensor) -> torch.Tensor:
    return tokens.roll(1, dims=1)


def pipe_reference_losses(
    data: list[torch.Tensor], *, blocks: int = 4, clip: float = 0.0
) -> tuple[list[float], PipeReference]:
    """What DeepSpeed's "Adam" (AdamW, weight decay 0.01) does in one process."""
    model = PipeReference(blocks)
    return plain_losses(WithLoss(model), data, lr=LR, clip=clip), model


def pipe_initialize(module: PipelineModule, cfg: dict[str, Any]) -> PipelineEngine:
    engine, *_ = zengine.initialize(model=module, config=cfg)
    assert isinstance(engine, PipelineEngine)
    return engine


def pipe_config(*, micro: int = 2, accumulation: int = 4, **extra: Any) -> dict[str, Any]:
    """A DeepSpeed config for the pipeline; `extra` keys added or replaced."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.01}},
        **extra,
    }


def micro_batches(
    tokens: torch.Tensor, accumulation: int, data_parallel: int, rank: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches of one global batch."""
    pieces = tokens.view(accumulation, data_parallel, -1, tokens.shape[-1])
    return iter([(pieces[k, rank], labels_of(pieces[k, rank])) for k in range(accumulation)])


def pipe_train(engine: PipelineEngine, data: list[torch.Tensor]) -> list[float]:
    """One ``train_batch`` per global batch; its losses."""
    grid = engine.grid
    accumulation = engine.gradient_accumulation_steps()
    dp, rank = grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()
    return [
        engine.train_batch(micro_batches(tokens, accumulation, dp, rank)).item() for tokens in data
    ]


def tied_weights_equal(module: PipelineModule) -> bool:
    """Whether this stage's tied embedding equals the lowest stage's (True where untied)."""
    if "embed" not in module._tied_groups:
        return True
    ranks, group = module._tied_groups["embed"]
    mine = module.tied_parameters("embed")[0].detach()
    first = mine.clone()
    zcomm.broadcast(first, ranks[0], group=group)
    return torch.equal(first, mine)
