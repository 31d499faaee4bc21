"""The engine: ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``, as DeepSpeed's.

It owns the model (``engine.module``), the ZeRO optimizer (``engine.optimizer``), the LR
scheduler and the loss scaler, counts micro-steps and steps, and prints progress. Everything
stage-specific lives in the layout (_optim/_layouts.py); everything about the config in _config/.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

import zcomm
import zpartition
from zengine import _checkpoint
from zengine._config import EngineConfig
from zengine._errors import UsageError
from zengine._offload import IdleTrimmer, StateOffloader, memory_held, nvme_offloader, trim_heap
from zengine._optim import Scheduler, ZeroOptimizer, autocast_dtype, forward_autocast
from zengine._progress import Progress
from zengine._unused_params import UnusedParameterCheck
from zoffload import OffloadDeviceEnum, OffloadStateTypeEnum, default_pool

__all__ = ["Engine", "UsageError", "half_floats"]


def half_floats(inputs: Any) -> Any:
    """``fp16.auto_cast``: every floating-point tensor in `inputs` (nested in lists, tuples and
    dicts) as float16, as DeepSpeed casts the forward's inputs; other values as they are."""
    return pytree.tree_map(
        lambda x: x.half() if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        inputs,
    )


class Engine(nn.Module):
    """What `zengine.initialize` returns first. Call it like the model."""

    # whether step() checks ignore_unused_parameters (the pipeline engine's step is its own)
    checks_unused_parameters: ClassVar[bool] = True
    pipeline_parallelism = False  # DeepSpeed's attribute: True for the pipeline engine

    def __init__(
        self,
        module: nn.Module,
        optimizer: ZeroOptimizer | None,
        lr_scheduler: Scheduler | None,
        *,
        config: EngineConfig,
        device: torch.device,
        partitioned: zpartition.Partitioned | None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.optimizer = optimizer  # None: initialize had none; forward passes only
        self.group = optimizer.group if optimizer is not None else group  # data-parallel
        self.lr_scheduler = lr_scheduler
        # the loader `initialize(training_data=...)` made (DeepSpeed's attribute), or None
        self.training_dataloader: Iterable[Any] | None = None
        self.config = config  # the resolved EngineConfig
        self.device = device
        self.partitioned = partitioned  # zpartition's handle at stage 3, else None
        self.global_steps = 0  # optimizer steps taken (or skipped on overflow)
        zcomm.set_activity(zcomm.CALLS[0], 0)  # a new engine: no call of an older one counts
        self.global_samples = 0
        self.micro_steps = 0  # backward passes taken
        # DeepSpeed's: modules whose gradients are reduced sparse. None here: the config
        # refuses sparse_gradients, so every gradient is reduced dense.
        self.sparse_tensor_module_names: set[str] = set()
        self._step_applied = False  # whether the last step() updated the parameters
        # inside no_sync() or coalesce_grad_reduction() (its name): backward passes reduce
        # nothing ([Note: holding gradients])
        self._holding: str | None = None
        # set_gradient_accumulation_boundary's word, under DeepSpeed's name (its tests read it)
        self._is_gradient_accumulation_boundary: bool | None = None
        # DeepSpeed's: False leaves the reduction at an accumulation boundary (stages 0, 1) to
        # allreduce_gradients(); whether this accumulation's gradients are reduced yet
        self.enable_backward_allreduce = True
        self._reduction: Literal["none", "pending", "done"] = "none"
        self.progress = Progress(self, config)
        self._autocast = autocast_dtype(config, device)  # torch_autocast's, None when off
        # ignore_unused_parameters false: a step refuses parameters left without a gradient
        checked = self.checks_unused_parameters and optimizer is not None
        self._unused = (
            UnusedParameterCheck(module, self.group)
            if checked and not config.zero_optimization.ignore_unused_parameters
            else None
        )
        self._offloaded = StateOffloader(nvme_offloader(config.aio))
        # Host memory freed by the steps goes back to the system when the engine sits idle
        # ([Note: returning memory on CPU]), with NVMe offload's staging buffers (unpinned on
        # CPU: nothing to pin again); on a GPU the host heap hardly churns.
        self._idle_trim = IdleTrimmer(
            enabled=device.type == "cpu" and config.host_memory_trim != "off",
            also=lambda: default_pool().trim(pinned=False),
        )

    def __getattr__(self, name: str) -> Any:
        """What the engine lacks, its model may have: DeepSpeed's engine hands unknown
        attributes to ``engine.module`` (``engine.generate(...)``,
        ``engine.gradient_checkpointing_enable()``, a model's own methods and submodules)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"neither the engine ({type(self).__name__}) nor its module "
                f"({type(module).__name__}) has an attribute {name!r}"
            ) from None

    def _trainer(self, call: str) -> ZeroOptimizer:
        """The optimizer, which `call` needs; an engine built without one says so."""
        if self.optimizer is None:
            raise RuntimeError(
                f"engine.{call}: this engine has no optimizer (initialize was given none and the "
                "config has no 'optimizer' section), so it runs forward passes only; pass "
                "optimizer=... or add an 'optimizer' section to train"
            )
        return self.optimizer

    # -- DeepSpeed's accessors -------------------------------------------------------------

    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def deepspeed_io(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Sampler[Any] | None = None,
        collate_fn: Callable[..., Any] | None = None,
        num_local_io_workers: int | None = None,
    ) -> DataLoader[Any]:
        """DeepSpeed's loader of `dataset`: micro-batches (`batch_size`, by default the
        config's), each data-parallel rank its share (a `DistributedSampler` unless
        `data_sampler` is given), `num_local_io_workers` loading processes (none by default),
        pinned only where there is a GPU. `route` (train, eval, predict) is DeepSpeed's label."""
        del route  # DeepSpeed times the training route; every route loads alike
        sampler = data_sampler or DistributedSampler(
            dataset, num_replicas=zcomm.get_world_size(self.group), rank=zcomm.get_rank(self.group)
        )
        return DataLoader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            sampler=sampler,
            collate_fn=collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self.device.type == "cuda",
            drop_last=bool(self.config.dataloader_drop_last),
        )

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def gradient_accumulation_steps(self) -> int:
        return int(self.config.gradient_accumulation_steps)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by the number of micro-batches accumulated, as DeepSpeed's
        (the micro-batch stays): `train_batch_size` must be a multiple of the micro-batch
        times the data-parallel ranks. Takes effect from the next accumulation."""
        unit = self.train_micro_batch_size_per_gpu() * zcomm.get_world_size(self.group)
        if (
            isinstance(train_batch_size, bool)
            or not isinstance(train_batch_size, int)
            or train_batch_size <= 0
            or train_batch_size % unit
        ):
            raise ValueError(
                f"engine.set_train_batch_size({train_batch_size!r}): expected a positive multiple "
                f"of train_micro_batch_size_per_gpu x data-parallel ranks = {unit}"
            )
        self.config = self.config.model_copy(
            update={
                "train_batch_size": train_batch_size,
                "gradient_accumulation_steps": train_batch_size // unit,
            }
        )

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` steps the optimizer (and the backward before it reduces
        the accumulated gradients): every ``gradient_accumulation_steps``-th micro-step, or as
        `set_gradient_accumulation_boundary` last said."""
        if self._is_gradient_accumulation_boundary is not None:
            return self._is_gradient_accumulation_boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say yourself whether the coming backward and ``step()`` end an accumulation, as
        DeepSpeed's (Hugging Face Accelerate drives the engine this way): set it before each
        micro-batch, True for the last one, and call ``step()`` after that one only."""
        if not isinstance(is_boundary, bool):
            raise TypeError(
                "engine.set_gradient_accumulation_boundary(is_boundary): expected a bool, got "
                f"{is_boundary!r}"
            )
        self._is_gradient_accumulation_boundary = is_boundary

    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self._trainer("get_lr()").param_groups]

    def get_mom(self) -> list[Any]:
        """Each parameter group's Adam betas, or its momentum where the optimizer has none."""
        return [
            g["betas"] if "betas" in g else g.get("momentum")
            for g in self._trainer("get_mom()").param_groups
        ]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm across all ranks at the last step, before clipping."""
        return None if self.optimizer is None else self.optimizer.global_grad_norm

    @property
    def global_rank(self) -> int:
        return zcomm.get_rank()

    @property
    def local_rank(self) -> int:
        return zcomm.get_local_rank()

    @property
    def world_size(self) -> int:
        return zcomm.get_world_size()

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks the gradients are averaged over."""
        return zcomm.get_world_size(self.group)

    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_stage)

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16_enabled)

    @property
    def gradient_average(self) -> bool:
        """Whether the ranks' gradients are averaged (``gradient_allreduce_op`` "mean"), not
        summed ([Note: gradient reduction])."""
        return bool(self.config.gradient_reduction.average)

    def postscale_gradients(self) -> bool:
        """Whether the division by the ranks comes after the sum (``prescale_gradients`` off)."""
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return float(self.config.gradient_predivide_factor)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16_enabled)

    def gradient_clipping(self) -> float:
        """The global norm gradients are clipped to (0: no clipping)."""
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int | float:
        """Optimizer steps between progress lines (``inf``: none)."""
        every: int | float = self.config.steps_per_print
        return every

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters: False between accumulation
        boundaries and when an overflow skipped the step (not an error, as in DeepSpeed)."""
        return self._step_applied

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because a gradient overflowed."""
        return 0 if self.optimizer is None else int(self.optimizer.skipped_steps)

    # -- the loop --------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        zcomm.set_activity("forward", self.global_steps)  # [Note: the watchdog] in zcomm
        self._idle_trim.busy()
        self._offloaded.require(self, "forward()", [OffloadStateTypeEnum.lp_params])
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = half_floats((args, kwargs))
        with self.progress.timed("forward"), forward_autocast(self._autocast, self.device):
            output = self.module(*args, **kwargs)
        if self.optimizer is None and self.partitioned is not None:
            # No backward follows in an engine without an optimizer: what the forward kept
            # gathered for one (all of it, on one rank) goes now, as DeepSpeed's trace does.
            self.partitioned.release_all(persistent=False)
        if not torch.is_grad_enabled():
            self._idle_trim.idle()  # an evaluation: no backward follows
        return output

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate `loss` (divided by the accumulation steps, times the fp16 loss scale)
        and reduce the gradients as the ZeRO stage says. Returns the loss divided by the
        accumulation steps (not by the loss scale), in the loss's dtype, as DeepSpeed's."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            raise TypeError(
                "engine.backward(loss): loss must be a tensor of one element, got "
                f"{type(loss).__name__}{shape}"
            )
        zero = self._trainer("backward()")
        zcomm.set_activity("backward", self.global_steps)
        self._offloaded.require(self, "backward()", OffloadStateTypeEnum)
        holding = self._holding is not None
        boundary = self.is_gradient_accumulation_boundary() and not holding
        # stages 2 and 3 reduce in every backward whatever enable_backward_allreduce says
        reduce = boundary and (self.enable_backward_allreduce or self.zero_optimization_stage() > 1)
        with self.progress.timed("backward"):
            if boundary:
                zero.prefetch_states()  # NVMe offload: read while backward runs
            zero.layout.hold_gradients(holding)
            zero.before_backward(reduce)
            share = loss.float()
            if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
                share = share / self.gradient_accumulation_steps()
            scaled = share if zero.loss_scaler is None else share * zero.cur_scale
            scaled.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
            zero.layout.after_backward(reduce)
        if boundary:
            self._reduction = "done" if reduce else "pending"
        self.progress.record_loss(loss)
        # fp32 above, so a half loss is scaled without rounding; the caller gets its own dtype
        return share.to(loss.dtype)

    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """Reduce this accumulation's gradients across the ranks now, if no backward did: with
        ``enable_backward_allreduce = False`` the boundary's backward leaves them to this call,
        and a rank that skips its backward joins the others' reduction with zero gradients
        (DeepSpeed's). Only at an accumulation boundary, and only at stages 0 and 1: stages 2
        and 3 reduce during every backward. A ``step()`` reduces what is still left. Every
        rank must call it. `bucket_size` is DeepSpeed's; ``reduce_bucket_size`` sets it here."""
        zero = self._trainer("allreduce_gradients()")
        if (
            self.zero_optimization_stage() > 1
            or not self.is_gradient_accumulation_boundary()
            or self._reduction == "done"
        ):
            return
        zero.layout.after_backward(True)
        self._reduction = "done"

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside reduce nothing across ranks: the gradients accumulate on each
        rank, and the next accumulation boundary's backward outside reduces all of it. As
        DeepSpeed's (its tests pin it): stages 0 and 1 only, not nested, and no ``step()``
        inside; at stages 1-3 `coalesce_grad_reduction` holds them likewise."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise UsageError(
                "engine.no_sync(): no_sync context manager is incompatible with gradient "
                f"partitioning: ZeRO stage {stage} partitions gradients while backward runs "
                "(DeepSpeed refuses it too); engine.coalesce_grad_reduction() holds them until "
                "one reduction, at stages 1-3"
            )
        self._hold("no_sync")
        try:
            yield
        finally:
            self._holding = None

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """DeepSpeed's: one with-block, one optimizer step. Backward passes inside reduce
        nothing, whatever boundary they are told; leaving the block reduces what they summed,
        once, as a boundary's backward would, and ``step()`` follows it (not inside). Stages
        1-3; each rank holds its full gradients until the end ([Note: holding gradients]). An
        exception inside leaves without reducing (a rank alone in a collective would hang)."""
        if self.pipeline_parallelism:
            raise NotImplementedError(
                "engine.coalesce_grad_reduction(): coalesce_grad_reduction is not supported under "
                "pipeline parallelism (a pipeline engine accumulates within train_batch())"
            )
        stage = self.zero_optimization_stage()
        if stage == 0:
            raise NotImplementedError(
                "engine.coalesce_grad_reduction(): coalesce_grad_reduction requires ZeRO stage "
                "1/2/3, got stage 0 (no_sync() holds the reduction at stage 0)"
            )
        zero = self._trainer("coalesce_grad_reduction()")
        self._hold("coalesce_grad_reduction")
        try:
            yield
        except BaseException:
            self._holding = None
            zero.layout.hold_gradients(False)
            raise
        self._holding = None
        with self.progress.timed("backward"):
            zero.layout.reduce_held()
        self._reduction = "done"

    def _hold(self, name: str) -> None:
        """Enter the context `name` whose backward passes reduce nothing (one at a time)."""
        if self._holding == name == "no_sync":
            raise UsageError(
                "engine.no_sync(): no_sync context manager reentry is unsupported (already "
                "inside no_sync(); it does not nest)"
            )
        if self._holding is not None:
            raise UsageError(
                f"engine.{name}(): {name} cannot be nested inside another no_sync context "
                f"(already inside {self._holding}())"
            )
        self._holding = name

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Step the optimizer at the accumulation boundary; otherwise only count. `lr_kwargs`
        go to the LR scheduler's ``step`` (DeepSpeed's)."""
        if self._holding is not None:
            raise UsageError(
                f"engine.step() inside engine.{self._holding}(): It is illegal to call "
                "Engine.step() inside no_sync context manager; the gradients are not reduced "
                "yet: step after leaving it"
            )
        zero = self._trainer("step()")
        zcomm.set_activity("step", self.global_steps)
        if self.partitioned is not None:
            # ranks agree that they all step before any reduces: a rank still in a forward or
            # a backward meets this header with its own, and every rank raises, naming each
            # one's call and step ([Note: agreement] in zpartition), instead of hanging
            self.partitioned.agree_on_step()
        self._offloaded.require(self, "step()", OffloadStateTypeEnum)
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self._unused is not None:
            self._unused.check()  # before anything counts or steps: a refused step loses nothing
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * zcomm.get_world_size(
            self.group
        )
        self._step_applied = False
        if not boundary:
            return
        if self._reduction == "pending":  # enable_backward_allreduce False, never reduced
            self.allreduce_gradients()
        self._reduction = "none"  # the next accumulation starts
        with self.progress.timed("step"):
            stepped = self._step_applied = zero.step()
            if stepped and self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        if self._unused is not None:
            self._unused.reset()
        self.progress.after_step()
        self._release_after_step()

    def _release_after_step(self) -> None:
        """Freed host memory back to the system now (``host_memory_trim: step``) or once the
        engine sits idle ([Note: returning memory on CPU])."""
        if self.config.host_memory_trim == "step":
            self._idle_trim.now()
        else:
            self._idle_trim.idle()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    # -- the model's parameters --------------------------------------------------------------

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def empty_partition_cache(self) -> None:
        """Release every ZeRO-3 parameter still gathered (a forward with gradients that no
        backward followed keeps them for one), and hand the freed memory back, as DeepSpeed's.
        Call it between passes; a backward still to come gathers what it needs again."""
        if self.partitioned is not None:
            self.partitioned.release_all()
        self._give_memory_back()

    def _give_memory_back(self) -> None:
        """Freed memory back to the system now: torch's cached GPU blocks to the driver (for
        another program, an inference engine, to take), or glibc's free heap."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            trim_heap()

    def offload_states(
        self,
        include: Iterable[OffloadStateTypeEnum | str] | None = None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
        nvme_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Move training states (all five types by default) to host memory or NVMe files,
        freeing their memory here; `reload_states` brings them back bit-exact."""
        self._trainer("offload_states()")
        zcomm.set_activity("offload_states", self.global_steps)
        if nvme_path is None:
            nvme_path = self.config.zero_optimization.offload_optimizer.nvme_path
        self._offloaded.offload(
            self,
            include,
            device,
            pin_memory=pin_memory,
            non_blocking=non_blocking,
            nvme_path=nvme_path,
        )
        self._give_memory_back()  # as DeepSpeed's offload_states empties torch's cache

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what `offload_states` moved, into the same tensors; with `non_blocking`
        the copies may run on (the engine's next call waits for them)."""
        zcomm.set_activity("reload_states", self.global_steps)
        self._offloaded.reload(non_blocking=non_blocking)

    def memory_held(self) -> dict[str, dict[str, int]]:
        """Bytes the engine holds now, by training state (DeepSpeed's five `offload_states`
        types, ``gathered_params``, ``total``) and by where they are (``cpu``, ``cuda:0``,
        ``nvme``); what `offload_states` moved counts zero on its device. See
        [Note: offload_states' footprint]."""
        return memory_held(self)

    # -- checkpoints (the _checkpoint subpackage) --------------------------------------------
    # Its modules that import torch.distributed.checkpoint (about a second) load at first use
    # (its names are looked up then: see its __init__). The public methods keep DeepSpeed's
    # signatures; what they are given goes down as one options object.

    def _write_checkpoint(self, options: _checkpoint.SaveOptions) -> bool:
        """One directory per tag (the pipeline engine writes one per stage under it), and
        with ``options.universal`` DeepSpeed's universal checkpoint of it beside it."""
        return _checkpoint.save_checkpoint(self, options)

    def _read_checkpoint(
        self, options: _checkpoint.LoadOptions
    ) -> tuple[str | None, dict[str, Any] | None]:
        """The reader of `_write_checkpoint`'s files."""
        return _checkpoint.load_checkpoint(self, options)

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        *,
        universal: bool = False,
    ) -> bool:
        """Save model, masters, optimizer, scheduler, loss scale, counters, RNG states and
        `client_state` under ``save_dir/tag``, then point ``save_dir/latest`` at it; without
        the frozen parameters with `exclude_frozen_parameters` (load those checkpoints with
        ``load_module_strict=False``). With `universal`, also DeepSpeed's universal checkpoint
        of it in ``save_dir/<tag>_universal``, named by ``save_dir/latest_universal`` (which
        DeepSpeed loads with ``"checkpoint": {"load_universal": true}``; written by rank 0).
        Collective."""
        self._trainer("save_checkpoint()")
        zcomm.set_activity("save_checkpoint", self.global_steps)
        self._offloaded.require(self, "save_checkpoint()", OffloadStateTypeEnum)
        options = _checkpoint.SaveOptions(
            save_dir, tag, client_state, save_latest, exclude_frozen_parameters, universal
        )
        return self._write_checkpoint(options)

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        *,
        load_module_strict: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/tag`` (default: the one ``latest`` names), saved at any world size;
        ``(path, client_state)``, or ``(None, None)`` when there is none. As DeepSpeed's,
        ``load_module_strict=False`` skips parameters and buffers only one side has, and
        ``load_module_only=True`` loads the weights alone; so does an engine without an
        optimizer (forward passes only: a trained model served at ZeRO-3). Collective."""
        zcomm.set_activity("load_checkpoint", self.global_steps)
        self._offloaded.require(self, "load_checkpoint()", OffloadStateTypeEnum)
        options = _checkpoint.LoadOptions(
            load_dir,
            tag,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_strict=load_module_strict,
            load_module_only=load_module_only,
        )
        return self._read_checkpoint(options)

    def _get_optimizer_ckpt_name(
        self, checkpoints_path: str | os.PathLike[str], tag: str, expp_rank: int = 0
    ) -> str:
        """DeepSpeed's name: where its checkpoint ``checkpoints_path/tag`` keeps the optimizer
        state of expert-parallel rank `expp_rank` of an MoE model outside ZeRO. zstack has no
        expert parallelism and refuses to load a DeepSpeed checkpoint holding such files."""
        directory = os.path.join(checkpoints_path, str(tag))
        return str(_checkpoint.expert_optim_name(Path(directory), expp_rank))

    def _change_recovery_script_permissions(self, dst: str | os.PathLike[str]) -> None:
        """DeepSpeed's: make the ``zero_to_fp32.py`` at `dst` executable; a file system that
        refuses (a file share) is logged, not raised, as ``save_checkpoint`` does."""
        _checkpoint.change_permissions(dst)

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike[str],
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Rank 0 writes the whole model's state dict in the compute dtype (at stage 3 only with
        ``stage3_gather_16bit_weights_on_model_save``; False otherwise). Collective."""
        return _checkpoint.save_16bit_model(
            self, save_dir, save_filename, exclude_frozen_parameters=exclude_frozen_parameters
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``stage3_gather_16bit_weights_on_model_save``: whether stage 3 may gather the whole
        model to save it (Hugging Face Accelerate asks before it does)."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, torch.Tensor]:
        """The whole model's state dict in the compute dtype, on the host, on rank 0 (empty on
        the others), gathered one module at a time: DeepSpeed's name, which Hugging Face
        Accelerate calls to save a ZeRO-3 model. Collective."""
        rank = dist.get_rank(self.group)
        return _checkpoint.gathered_state(self, rank, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    def destroy(self) -> None:
        """Take the hooks off and drop the optimizer's buffers (DeepSpeed's ``destroy``)."""
        if self.partitioned is not None:
            self.partitioned.remove(gather=False)
            self.partitioned = None
        if self.optimizer is not None:
            self.optimizer.layout.remove()
            self.optimizer.destroy()
        if self._unused is not None:
            self._unused.remove()
        self._idle_trim.close()
