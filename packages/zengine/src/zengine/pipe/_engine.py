"""`PipelineEngine`: DeepSpeed's ``train_batch`` and ``eval_batch``, running zpipe schedules.

Each rank runs its stage's instructions of the schedule the config names (1F1B by default),
checked first against the other stages' (_agreement.py) and, on gloo, with each send moved up
to right after its computation (_eager.py); activations and gradients travel between stages as
in _link.py, the data-parallel ranks of a stage reduce its gradients (ZeRO 0 or 1) and every
stage steps its own parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Literal, NoReturn, overload

import torch
import torch.distributed as dist
from torch import nn

import zcomm
import zpipe
from zengine import _recompute as checkpointing
from zengine._checkpoint import LoadOptions, SaveOptions
from zengine._config import EngineConfig, PipelineConfig
from zengine._engine import Engine
from zengine._optim import Scheduler
from zengine.pipe import _checkpoint as stage_checkpoints
from zengine.pipe._agreement import check_agreement
from zengine.pipe._eager import EagerSends
from zengine.pipe._errors import PipelineError
from zengine.pipe._link import Link
from zengine.pipe._module import PipelineModule
from zengine.pipe._optimizer import PipeZeroOptimizer
from zengine.pipe._run import BatchRun, StageContext
from zengine.utils import RepeatingLoader
from zoffload import OffloadStateTypeEnum

__all__ = ["SCHEDULES", "ForwardOnly", "PipelineEngine"]

#: The config's ``pipeline.schedule`` names.
SCHEDULES: dict[str, type[zpipe.PipeSchedule]] = {
    "1f1b": zpipe.TrainSchedule,
    "gpipe": zpipe.GPipeSchedule,
    "interleaved": zpipe.Interleaved1F1BSchedule,
    "zero_bubble": zpipe.ZeroBubbleH1Schedule,
}
_FORWARD = (zpipe.LoadMicroBatch, zpipe.ForwardPass, zpipe.SendActivation, zpipe.RecvActivation)


def _in_order(micro_batch: int | None) -> int:
    """Results by micro-batch id, in order; None is a schedule's without ids (its only key)."""
    return -1 if micro_batch is None else micro_batch


class ForwardOnly(zpipe.PipeSchedule):
    """The forward instructions of a training schedule: how a model in several chunks per
    stage is evaluated (InferenceSchedule has one chunk). Dropping the backward half keeps
    the messages of the forward in the same order on both ends, so it cannot deadlock."""

    def __init__(self, base: zpipe.PipeSchedule) -> None:
        super().__init__(base.micro_batches, base.stages, base.stage_id)
        self.base = base
        self.chunks = base.chunks

    def steps(self) -> Iterator[list[zpipe.PipeInstruction]]:
        for step in self.base:
            kept: list[zpipe.PipeInstruction] = [c for c in step if isinstance(c, _FORWARD)]
            if kept:
                yield kept

    def virtual_stage(self, chunk_id: int) -> int:
        return self.base.virtual_stage(chunk_id)

    def owner(self, virtual_stage: int) -> tuple[int, int]:
        return self.base.owner(virtual_stage)


class PipelineEngine(Engine):
    """What `zengine.initialize` returns for a `PipelineModule`: ``train_batch(data_iter)``
    runs one batch (``gradient_accumulation_steps`` micro-batches) and steps; ``eval_batch``
    runs the forward only. ``engine(x)``, ``backward`` and ``step`` are not available, as in
    DeepSpeed. `train_schedule_cls` may be set to any zpipe schedule class."""

    module: PipelineModule
    optimizer: PipeZeroOptimizer
    # ignore_unused_parameters is not checked: the schedule steps itself, and its split backward
    # writes .grad past the hooks that would see the gradients arrive
    checks_unused_parameters = False
    pipeline_parallelism = True

    def __init__(
        self,
        module: PipelineModule,
        optimizer: PipeZeroOptimizer,
        lr_scheduler: Scheduler | None,
        *,
        config: EngineConfig,
        device: torch.device,
    ) -> None:
        super().__init__(
            module, optimizer, lr_scheduler, config=config, device=device, partitioned=None
        )
        self.grid = module.mpu()
        self.stage_id = module.stage_id
        self.num_stages = module.num_stages
        self.chunks = module.chunks
        self.micro_batches = self.gradient_accumulation_steps()
        self.train_schedule_cls: type[zpipe.PipeSchedule] = SCHEDULES[config.pipeline.schedule]
        self.link = Link(
            self.stage_id,
            self.num_stages,
            self.grid.stage_to_global,
            config.pipeline.p2p_timeout,
            device,
        )
        self._params = [p for p in module.parameters() if p.requires_grad]
        # the schedules built (and checked against the other stages), by class and eagerness
        self._schedules: dict[tuple[type[zpipe.PipeSchedule], bool], zpipe.PipeSchedule] = {}
        #: send each activation and input gradient as soon as it is computed (see _eager.py);
        #: on by default where sends are buffered (gloo). On NCCL a send waits for its receive
        #: in the stream's order, and only the schedule's own order is proved deadlock-free.
        self.eager_sends = dist.get_backend(self.grid.get_pipe_parallel_group()) == "gloo"
        #: post each stage's next receive as soon as its frame's size is known, so that a
        #: message moves while this stage computes (`Link.post_ahead`); on for gloo, whose
        #: receives are matched apart from its sends. On NCCL a posted receive would hold up
        #: the sends queued after it on the same stream.
        self.receive_ahead = self.eager_sends
        #: the loader of `initialize(training_data=...)`: what train_batch() reads by default
        self._data_iterator: Iterator[Any] | None = None
        #: set to a dict to record each computation's seconds by kind: "F" (forward), "B"
        #: (backward), "I" and "W" (the halves of a split backward); None records nothing
        self.compute_times: dict[str, list[float]] | None = None
        self._configure_checkpointing(config.pipeline)

    def _configure_checkpointing(self, pipe: PipelineConfig) -> None:
        """The config's activation checkpointing, as DeepSpeed's engine sets it on the module:
        ``use_reentrant`` false picks the non-reentrant function whatever the interval (the
        module's `set_checkpoint_interval` may turn checkpointing on later), and a positive
        ``activation_checkpoint_interval`` replaces the module's."""
        reentrant = pipe.use_reentrant
        if reentrant is None:  # DeepSpeed's default, true, where the schedule can run it
            reentrant = pipe.schedule != "zero_bubble"
        if not reentrant:
            self.module.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
        if pipe.activation_checkpoint_interval > 0:
            self.module.activation_checkpoint_interval = pipe.activation_checkpoint_interval
        self.module._precompute_checkpointable_values()

    def _reentrant_activation_checkpointing(self) -> bool:
        """DeepSpeed's: whether the module checkpoints with a reentrant function (any but
        `checkpointing.non_reentrant_checkpoint`), read from the module at each batch since
        `set_checkpoint_interval` may change it. The first stage's floating-point inputs then
        require grad: a reentrant checkpoint of the first segment would otherwise cut it off
        from autograd."""
        module = self.module
        if module.activation_checkpoint_interval <= 0:
            return False
        return module.activation_checkpoint_func is not checkpointing.non_reentrant_checkpoint

    def _write_checkpoint(self, options: SaveOptions) -> bool:
        """One checkpoint per stage under one 'latest' (pipe/_checkpoint.py)."""
        if options.universal:  # refused alike on every rank, before anything is written
            raise ValueError(
                "save_checkpoint(universal=True): DeepSpeed's universal checkpoint of a pipeline "
                "(one checkpoint per stage) is not written yet; save without it"
            )
        return stage_checkpoints.save_checkpoint(self, options)

    def _read_checkpoint(self, options: LoadOptions) -> tuple[str | None, dict[str, Any] | None]:
        return stage_checkpoints.load_checkpoint(self, options)

    # -- DeepSpeed's pipeline accessors --------------------------------------------------------

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters a chunk's backward may reach (this stage's trainable ones)."""
        return self._params

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """As the engine's: the batch runs more or fewer micro-batches from the next one."""
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()
        self._schedules.clear()  # made for the old number of micro-batches

    def _stage_context(self, *, computes_loss: bool = True) -> StageContext:
        """What this batch's run reads of the engine (taken now: none of it changes while a
        batch runs; the loss scale changes at its last instruction, the step)."""
        fp16 = self.config.fp16
        return StageContext(
            stage=self.stage_id,
            virtual_stages=self.num_stages * self.chunks,
            device=self.device,
            module=self.module,
            layout=self.optimizer.layout,
            link=self.link,
            autocast=self._autocast,
            half_inputs=fp16.enabled and fp16.auto_cast,
            inputs_need_grad=self._reentrant_activation_checkpointing(),
            loss_factor=self.loss_factor(),
            computes_loss=computes_loss,
            receive_ahead=self.receive_ahead,
            compute_times=self.compute_times,
            chunk_parameters=self.chunk_parameters,
            optimizer_step=self.optimizer_step,
        )

    def loss_factor(self) -> float:
        """What the last stage multiplies each micro-batch's loss by before its backward:
        the mean over micro-batches, times the fp16 loss scale."""
        return self.optimizer.cur_scale / self.micro_batches

    def optimizer_step(self) -> None:
        """``OptimizerStep``: step, and the LR schedule unless an overflow skipped the step."""
        with self.progress.timed("step"):
            stepped = self._step_applied = self.optimizer.step()
            if stepped and self.lr_scheduler is not None:
                self.lr_scheduler.step()

    # -- the batches ---------------------------------------------------------------------------

    def set_dataloader(self, loader: Iterable[Any]) -> None:
        """What ``train_batch()`` reads when given no iterator (DeepSpeed's): `loader`, from its
        start, started again whenever it ends."""
        self.training_dataloader = loader
        self._data_iterator = None

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """What ``train_batch()`` reads when given no iterator (DeepSpeed's): `iterator`, from
        where it is, until it ends."""
        self._data_iterator = iterator

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one batch from `data_iter` (``(inputs, labels)`` micro-batches, read on
        the first and the last stage; by default the iterator of the last call that gave one,
        or the loader of ``initialize(training_data=)``, restarted when it ends) and step;
        returns the mean loss, on every rank."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() needs gradients: it was called under no_grad")
        if data_iter is not None:
            self.set_dataiterator(data_iter)  # DeepSpeed's: train_batch() goes on with it
        elif self._data_iterator is None and self.training_dataloader is not None:
            self._data_iterator = RepeatingLoader(self.training_dataloader)
        data_iter = self._data_iterator
        zcomm.set_activity("train_batch", self.global_steps)  # [Note: the watchdog] in zcomm
        self.module.train()
        self._idle_trim.busy()
        self._offloaded.require(self, "train_batch()", OffloadStateTypeEnum)
        self.optimizer.before_backward(boundary=True)  # the batch ends with a step
        schedule = self._schedule(self.train_schedule_cls)
        run = BatchRun(self._stage_context(), schedule, data_iter, train=True)
        run.execute()
        loss = self._batch_loss(run.losses)
        self.micro_steps += self.micro_batches
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.progress.record_loss(loss)
        self.progress.after_step()
        self._release_after_step()
        return loss

    # what eval_batch returns follows its flags: the loss; the loss and the outputs; the outputs
    @overload
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: Literal[False] = False,
        compute_loss: Literal[True] = True,
    ) -> torch.Tensor: ...
    @overload
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None,
        return_logits: Literal[True],
        compute_loss: Literal[True] = True,
    ) -> tuple[torch.Tensor, list[Any] | None]: ...
    @overload
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        *,
        return_logits: Literal[True],
        compute_loss: Literal[True] = True,
    ) -> tuple[torch.Tensor, list[Any] | None]: ...
    @overload
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        *,
        compute_loss: Literal[False],
    ) -> list[Any] | None: ...
    @overload
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
    ) -> torch.Tensor | tuple[torch.Tensor, list[Any] | None] | list[Any] | None: ...
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
    ) -> torch.Tensor | tuple[torch.Tensor, list[Any] | None] | list[Any] | None:
        """Run the forward of one batch; returns the mean loss on every rank (and, with
        `return_logits`, the last stage's outputs per micro-batch; None on other stages).
        Without `compute_loss`, the outputs alone."""
        was_training = self.module.training
        zcomm.set_activity("eval_batch", self.global_steps)
        self._idle_trim.busy()
        self._offloaded.require(self, "eval_batch()", [OffloadStateTypeEnum.lp_params])
        self.module.eval()
        if self.chunks == 1:
            schedule = self._schedule(zpipe.InferenceSchedule)
        else:
            schedule = ForwardOnly(self._schedule(self.train_schedule_cls))
        try:
            context = self._stage_context(computes_loss=compute_loss)
            run = BatchRun(context, schedule, data_iter, train=False)
            run.execute()
        finally:
            self.module.train(was_training)
            self._idle_trim.idle()
        outputs = (
            [run.outputs[k] for k in sorted(run.outputs, key=_in_order)]
            if self.is_last_stage()
            else None
        )
        if not compute_loss:
            return outputs
        loss = self._batch_loss(run.losses)
        return (loss, outputs) if return_logits else loss

    def _make(self, cls: type[zpipe.PipeSchedule], stage: int) -> zpipe.PipeSchedule:
        kwargs = {"chunks": self.chunks} if self.chunks > 1 else {}
        return cls(
            micro_batches=self.micro_batches, stages=self.num_stages, stage_id=stage, **kwargs
        )

    def _schedule(self, cls: type[zpipe.PipeSchedule]) -> zpipe.PipeSchedule:
        """This stage's schedule of `cls`, checked against the other stages' the first time,
        with its sends moved up where they never block (`eager_sends`)."""
        key = (cls, self.eager_sends)
        if key in self._schedules:
            return self._schedules[key]
        schedule = self._make(cls, self.stage_id)
        if schedule.chunks != self.chunks:
            raise PipelineError(
                f"{cls.__name__} runs {schedule.chunks} chunk(s) per stage, but the "
                f"PipelineModule has chunks={self.chunks}",
                stage=self.stage_id,
            )
        group = self.grid.get_pipe_parallel_group()
        check_agreement(schedule, self._make, group=group)
        if self.eager_sends:
            kwargs = {"chunks": self.chunks} if self.chunks > 1 else {}
            schedule = EagerSends(
                self.micro_batches, self.num_stages, self.stage_id, base=cls, **kwargs
            )
        self._schedules[key] = schedule
        return schedule

    def _batch_loss(self, losses: dict[int | None, torch.Tensor]) -> torch.Tensor:
        """The mean loss of the batch over micro-batches and data-parallel ranks, sent from
        the last stage to all others (every rank returns it)."""
        value = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.is_last_stage() and losses:
            value = torch.stack([losses[k].float() for k in sorted(losses, key=_in_order)]).mean()
            zcomm.all_reduce(
                value, op=zcomm.ReduceOp.AVG, group=self.grid.get_data_parallel_group()
            )
        last = self.grid.stage_to_global(self.num_stages - 1)
        zcomm.broadcast(value, last, group=self.grid.get_pipe_parallel_group())
        return value

    # -- what a pipeline engine does not do ----------------------------------------------------

    # (each takes what the engine's own takes, any arguments of the model's forward included)

    def forward(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch()")

    def backward(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch()")

    def step(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch()")

    def no_sync(self) -> NoReturn:
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch()")

    def allreduce_gradients(self, bucket_size: int | None = None) -> NoReturn:
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch()")
