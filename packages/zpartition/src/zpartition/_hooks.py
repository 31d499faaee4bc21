"""The hooks: gather before a module runs forward or backward, release after, reduce gradients.

[Note: hooks]
Only modules with partitioned parameters somewhere below them get hooks; a leaf module or a
group of small modules ([Note: module groups]) gets them and its children none. Per module
and pass:
- forward pre-hook: push the module on the stack, fetch its units (own and external);
- forward hook: pop; adopt parameters returned in the output (they become external parameters
  of the module that consumes them); when grad is on, put a pre-hook on the ``grad_fn`` of each
  output tensor (it fetches the units again before the module's backward runs); release;
- on each trainable parameter, a post-accumulate-grad hook counts arrivals; when a unit's last
  gradient arrived its backward is over: queue its gradients for reduction (see _reduce.py),
  release it (with one rank nothing moves, so no hooks: the end of backward takes gradients);
- at the end of backward (an autograd engine callback): queue what is left (parameters that got
  no gradient contribute zeros), reduce the queue, agree across ranks that the pass ended
  alike, release all; with replicas, all-reduce the held gradients across them when this
  backward requires it ([Note: hybrid sharding], `_hybrid.py`). A backward without gradient
  sync holds the full gradients instead of queueing them ([Note: gradient sync], `_reduce.py`).
With a secondary partition, a forward's gathers keep a secondary shard of each unit and the
backward's fetches gather from it and drop it; the end of backward drops what is left
([Note: secondary partition], `_secondary.py`).
Outputs are walked with torch's pytree; objects it does not know are searched one level deep
through their attributes, so dataclasses and plain objects pass through untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from zpartition._channel import Channel, Kind
from zpartition._coordinator import Coordinator
from zpartition._errors import ZeroParamError
from zpartition._external import register_external_parameter, unregister_external_parameter
from zpartition._param import ZeroParameter, zero_params
from zpartition._partial import PartialGradients
from zpartition._reduce import (
    Deliver,
    GradBucket,
    GradientSink,
    accumulate,
    hold,
    keep_local,
    reduction_dtype,
    to_sink,
)
from zpartition._shard import check_bound
from zpartition._status import ZeroParamStatus
from zpartition._unit import GradKey, Unit, _GradGroup

__all__ = ["ModuleInfo", "State", "eager"]

_MAX_PENDING = 4
"""Root forwards before one backward that get traces of their own; later ones (a loop of
forwards with grad and no backward: an evaluation without no_grad) share the last kind."""

_Tensor = torch.Tensor
_NOT_AVAILABLE = ZeroParamStatus.NOT_AVAILABLE


def _not_installed(*_: Any) -> None:
    raise AssertionError("zpartition: a module's backward hook ran before its hooks were installed")


@dataclasses.dataclass(eq=False)
class ModuleInfo:
    """What the hooks of one module need, found once at registration."""

    module: nn.Module
    mid: int  # the module's id as a user of units
    name: str  # qualified name in the model, for messages
    own: tuple[Unit, ...]  # the units of its own parameters (of its subtree when a leaf)
    # the modules whose parameters and external parameters it fetches: itself, and its
    # subtree when a leaf or a group ([Note: module groups])
    members: tuple[nn.Module, ...]
    units: tuple[Unit, ...] = ()  # own plus the units of its external parameters
    backward_pass: int = -1  # the pass in which its backward last fetched
    pre_backward: Callable[..., None] = _not_installed  # its grad_fn pre-hook, made once
    hooks: list[Any] = dataclasses.field(default_factory=list)  # its forward hooks' handles


def _tensors(output: Any) -> Iterator[_Tensor]:
    """Every tensor in `output`: pytree containers, then one level of unknown objects."""
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, _Tensor):
            yield leaf
        elif leaf is not None and hasattr(leaf, "__dict__") and not isinstance(leaf, type):
            for value in vars(leaf).values():
                if isinstance(value, _Tensor):
                    yield value
                elif isinstance(value, (tuple, list, dict)):
                    yield from (t for t in pytree.tree_leaves(value) if isinstance(t, _Tensor))


class State:
    """The running state of one partitioned model: module stack, passes, backward."""

    def __init__(
        self,
        root: nn.Module,
        infos: dict[nn.Module, ModuleInfo],
        coordinator: Coordinator,
        persistent: Unit | None,
        channel: Channel,
    ) -> None:
        self.root = root
        self.infos = infos
        self.coordinator = coordinator
        self.persistent = persistent  # the unit of every persistent parameter, or None
        self.channel = channel
        self.stack: list[ModuleInfo] = []  # modules whose forward is running, innermost last
        self.passes = 0  # passes begun; a backward fetches each module once per pass
        self.in_backward = False  # between a backward's first hook and its end callback
        # root forwards with grad since the last backward ended: the model run twice before
        # one backward (siamese, a policy on chosen and rejected) is two passes of kinds
        # of their own, the second one's trace holding the backward of both
        self.forwards_pending = 0
        self.handles: list[Any] = []  # removable hook handles
        self.units: list[Unit] = []  # every unit with trainable parameters, in order
        self.buckets: dict[GradKey, GradBucket] = {}  # gradients waiting, by group key
        self.bucket_columns: dict[GradKey, int] = {}  # a bucket's width, set at install
        self.root_device = torch.device("cpu")  # where gradients are computed (set at install)
        self.late_gradients = False  # gradients taken at the end of backward (see install)
        self.sink: GradientSink | None = None  # takes reduced gradients instead of .grad
        # with a replicate group: the gradients held until the replicas' all-reduce, and
        # whether this backward ends with it ([Note: hybrid sharding])
        self.replicas: PartialGradients | None = None
        self.requires_all_reduce = True
        # node-local accumulation: the gradients held between the node's reduction and the
        # one across nodes, and (this node's group, nodes, local rank) ([Note: node-local
        # accumulation], `_partial.py`)
        self.node_local: PartialGradients | None = None
        self.node_split: tuple[dist.ProcessGroup, int, int] | None = None
        # False: backward passes hold full gradients instead of reducing ([Note: gradient
        # sync]); `unsynced` by id(param), `unsynced_units` the units they belong to
        self.requires_gradient_sync = True
        # quantized gradients (qgZ): (block size, hierarchical over the nodes), or None
        self.quantize: tuple[int, bool] | None = None
        self.unsynced: dict[int, torch.Tensor] = {}
        self.unsynced_units: dict[Unit, None] = {}
        # reduce-scatters in flight, to finish, with the key of the bucket each reads
        self.reducing: list[tuple[GradKey, Callable[[], None]]] = []
        self.kept_buckets = False  # persistent_grad_buckets (set at install)
        self.grad_buffers: dict[GradKey, torch.Tensor] = {}  # persistent_grad_buckets
        self.buffers_busy: set[GradKey] = set()  # read by a reduce-scatter in flight
        every = [*coordinator.units.values(), *([persistent] if persistent is not None else [])]
        # parameters whose shard was written through `ds_tensor` since an engine last asked
        # (`Partitioned.take_written`), and each parameter's attributes with its shard, checked
        # once a pass for a rebound `ds_tensor`: see [Note: shard writes]
        self.written: list[ZeroParameter] = []
        self.bound = [pair for unit in every for pair in unit.bound]
        for unit in every:
            unit.journal = self.written

    # -- registration ----------------------------------------------------------------------

    def install(self) -> None:
        for info in self.infos.values():
            self._install_module(info)
        # One rank, and the live limit never binds: nothing is freed or moved during backward,
        # so gradients are taken at its end and the per-parameter hooks are not needed. Not
        # where shards wait in a store (NVMe): each unit is let go as its backward ends.
        total = sum(u.numel for u in self.coordinator.units.values())
        # A kept bucket (persistent_grad_buckets) is used with one rank too: DeepSpeed's
        # contiguous gradient buffer exists whatever the world size, and offload frees it.
        self.kept_buckets = self.coordinator.config.persistent_grad_buckets
        # with replicas every gradient goes through a bucket, even a shard group of one
        # rank's: that is where the pre-factor is applied and the results are held
        self.late_gradients = (
            self.replicas is None
            and self.node_local is None
            and all(u.direct for u in self.units)
            and total <= self.coordinator.config.max_live_parameters
            and not self.kept_buckets
            and all(u.store is None for u in self.units)
        )
        # A bucket holds reduce_bucket_size elements, or every gradient if fewer: its columns
        # are one rank's share of that.
        limit = max(1, self.coordinator.config.reduce_bucket_size // self.channel.size)
        for unit in self.units:
            for group in unit.grad_groups:
                key = (group.dtype, group.comm)
                columns = self.bucket_columns.get(key, 0) + group.width
                self.bucket_columns[key] = min(columns, limit)
        self.root_device = self.units[0].device if self.units else torch.device("cpu")
        if not self.late_gradients:
            self._hook_gradients()

    def _hook_gradients(self) -> None:
        """A post-accumulate-grad hook on each trainable parameter (its arrival counted)."""
        for unit in self.units:
            hook = self._grad_arrived(unit)
            for p in unit.params:
                if p.requires_grad:
                    handle = p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
                    self.handles.append(handle)

    def shards_stored(self) -> None:
        """The units' shards now wait in a store (`Partitioned.set_shard_store`, between
        steps): gradients are taken as each unit's backward ends, and the unit let go then,
        rather than every unit held to the end of backward (see `install`)."""
        if self.late_gradients:
            self.late_gradients = False
            self._hook_gradients()

    def _install_module(self, info: ModuleInfo) -> None:
        info.pre_backward = eager(self._pre_backward(info))
        self._hook_forward(info)
        for member in info.members:
            member.__dict__["_zp_on_externals_changed"] = lambda: self._externals_changed(info)
        self.refresh_units(info)

    def _hook_forward(self, info: ModuleInfo, *, first: bool = False) -> None:
        """`first`: ahead of the module's other hooks (hooks put back after `unhook_forward`
        keep the place they had, before hooks added since the model was partitioned)."""
        module = info.module
        pre = self._begin_pass if module is self.root else None
        # torch.compile runs the hooks as they are, between the graphs it makes of the
        # modules' own computation: they move storage under the parameters, which a graph
        # cannot hold (DeepSpeed keeps its hooks out of the compiler too)
        info.hooks = [
            module.register_forward_pre_hook(eager(self._pre_forward(info, pre)), prepend=first),
            module.register_forward_hook(eager(self._post_forward(info)), prepend=first),
        ]
        self.handles += info.hooks

    @property
    def forward_hooked(self) -> bool:
        return any(info.hooks for info in self.infos.values())

    def unhook_forward(self) -> None:
        """Take every module's forward hooks off (`hook_forward` puts them back)."""
        for info in self.infos.values():
            for handle in info.hooks:
                handle.remove()
                self.handles.remove(handle)
            info.hooks = []

    def hook_forward(self) -> None:
        for info in self.infos.values():
            self._hook_forward(info, first=True)

    def _externals_changed(self, info: ModuleInfo) -> None:
        self.refresh_units(info)
        self.coordinator.forget_recording()

    def refresh_units(self, info: ModuleInfo) -> None:
        """Recompute the units a module fetches after its external parameters changed."""
        units = list(info.own)
        for member in info.members:
            for p in member.__dict__.get("_external_params", {}).values():
                unit = p.ds_unit
                if unit is not None and not unit.persistent and unit not in units:
                    units.append(unit)
        info.units = tuple(units)

    # -- forward ---------------------------------------------------------------------------

    def _pre_forward(
        self, info: ModuleInfo, begin: Callable[[nn.Module], None] | None
    ) -> Callable[[nn.Module, Any], None]:
        stack, fetch, prefetch = self.stack, self.coordinator.fetch, self.coordinator.prefetch

        def hook(module: nn.Module, args: Any) -> None:
            if begin is not None:
                begin(module)
            stack.append(info)
            if info.units:
                fetch(info.units, info.mid)
            elif begin is not None:
                prefetch()  # a root with no parameters of its own: its children's are due

        return hook

    def _post_forward(self, info: ModuleInfo) -> Callable[[nn.Module, Any, Any], None]:
        stack, release, grad_enabled = self.stack, self.coordinator.release, torch.is_grad_enabled

        root = info.module is self.root

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if stack and stack[-1] is info:
                stack.pop()
            if output is not None and type(output) is not _Tensor:
                self._adopt_returned(info, output)
            units = info.units
            if (units or root) and grad_enabled():
                # the root's hook starts every backward, even when it has no units itself
                if type(output) is _Tensor and output.grad_fn is not None:
                    output.grad_fn.register_prehook(info.pre_backward)  # the common case
                else:
                    self._hook_backward(info, output)
            # A forward run again in backward (activation checkpointing) of a module whose
            # backward has begun keeps its units: that backward reads what this forward saves,
            # and nothing would gather them again (torch's non-reentrant checkpoint stops its
            # recomputation early, before this hook, unless told not to).
            if units and not (self.in_backward and info.backward_pass == self.passes):
                release(units, info.mid)

        return hook

    def _begin_pass(self, module: nn.Module) -> None:
        check_bound(self.bound)  # a `ds_tensor` rebound since the last pass raises here
        if self.stack:
            self.stack.clear()  # a forward that raised left its modules on the stack
        self.passes += 1
        grad = torch.is_grad_enabled()
        position = min(self.forwards_pending, _MAX_PENDING) if grad else 0
        self.forwards_pending += grad
        self.coordinator.begin_pass((module.training, grad, position))
        if self.persistent is not None:
            self.persistent.refresh()  # the optimizer changed the shards: gather them again

    def _adopt_returned(self, info: ModuleInfo, output: Any) -> None:
        """Parameters returned from `info`'s forward become external parameters of the module
        that called it, so they stay gathered while that module uses them."""
        returned = zero_params(t for t in _tensors(output) if hasattr(t, "ds_id"))
        if not returned or not self.stack:
            return
        parent = self.stack[-1]
        for p in returned:
            if any(p.ds_id in m.module.__dict__.get("_external_params", {}) for m in self.stack):
                continue
            register_external_parameter(parent.module, p)
            if p.ds_id in info.module.__dict__.get("_external_params", {}):
                unregister_external_parameter(info.module, p)
            if p.ds_unit is not None and not p.ds_unit.persistent:
                p.ds_unit.users.add(parent.mid)  # it is gathered now: keep it for the parent

    def read(self, owner: ModuleInfo, param: ZeroParameter) -> None:
        """`param`, owned by `owner`'s module, was read through its attribute; if another
        module is running, register it there and hold it gathered for that module."""
        stack = self.stack
        if not stack or stack[-1] is owner:
            return  # outside any forward (inspection), or the owner reading its own
        running, unit = stack[-1], param.ds_unit
        if unit is None or unit.persistent or running.mid in unit.users:
            return
        if param.ds_id not in running.module.__dict__.get("_external_params", {}):
            register_external_parameter(running.module, param)
        # a parameter's unit is a Unit (_param declares it by what its readers use)
        self.coordinator.fetch((cast(Unit, unit),), running.mid)

    # -- backward --------------------------------------------------------------------------

    def _hook_backward(self, info: ModuleInfo, output: Any) -> None:
        fetch = info.pre_backward
        tensors = (output,) if type(output) is _Tensor else _tensors(output)
        for t in tensors:
            if t.requires_grad:
                grad_fn = t.grad_fn
                if grad_fn is not None:
                    grad_fn.register_prehook(fetch)
                else:
                    t.register_hook(fetch)  # type: ignore[no-untyped-call]

    def _pre_backward(self, info: ModuleInfo) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if not self.in_backward:
                self._start_backward()
            if info.backward_pass != self.passes and info.units:
                info.backward_pass = self.passes
                self.coordinator.fetch(info.units, info.mid)

        return hook

    def _grad_arrived(self, unit: Unit) -> Callable[[ZeroParameter], None]:
        def hook(param: ZeroParameter) -> None:
            if not self.in_backward:
                self._start_backward()
            unit.ready += 1
            if unit.ready == unit.trainable:
                self._gradients_done(unit)

        return hook

    def _gradients_done(self, unit: Unit) -> None:
        """`unit`'s backward is over: queue its gradients for reduction, release it."""
        unit.ready = 0
        if unit.direct and not self.kept_buckets and self.replicas is None:  # one rank
            keep_local(unit, self.sink)
        elif not self.requires_gradient_sync:
            hold(unit, self.unsynced, self.coordinator.config.reduce_dtype)
            self.unsynced_units[unit] = None
        else:
            self._queue(unit)
        if not unit.persistent:
            unit.users.clear()
            self.coordinator.release((unit,), -1)

    def _queue(self, unit: Unit) -> None:
        """Put `unit`'s gradients, with what was held for them, in their buckets."""
        self.unsynced_units.pop(unit, None)
        for group in unit.grad_groups:
            self._bucket_for(group).add(unit, group, self.unsynced)

    def _bucket_for(self, group: _GradGroup) -> GradBucket:
        key = (group.dtype, group.comm)
        bucket = self.buckets.get(key)
        if bucket is not None and not bucket.fits(group):
            self._flush(key)
            bucket = None
        if bucket is None:
            width = max(self.bucket_columns.get(key, 0), group.width)
            dtype = reduction_dtype(group, self.coordinator.config.reduce_dtype)
            rows = self._kept_rows(key, width, dtype)
            scale = self.coordinator.config.reduce_scale
            if scale is not None and (self.replicas or self.node_local) is not None:
                scale = (scale[0], 1.0)  # the post-factor after the second stage's sum
            bucket = GradBucket(
                dtype,
                width,
                self.channel,
                self.root_device,
                rows,
                scale,
                self.node_split,
                self.quantize,
            )
            self.buckets[key] = bucket
        return bucket

    def _kept_rows(self, key: GradKey, width: int, rows_dtype: torch.dtype) -> torch.Tensor | None:
        """The persistent bucket of the gradients of group `key`, held in `rows_dtype` (None
        without persistent_grad_buckets). One per key: a bucket still being reduce-scattered
        from it is finished first."""
        if not self.kept_buckets:
            return None
        if key in self.buffers_busy:
            self._finish_reductions()
        rows = self.grad_buffers.get(key)
        if rows is None or rows.shape[1] < width:
            rows = torch.empty(self.channel.size, width, dtype=rows_dtype, device=self.root_device)
            self.grad_buffers[key] = rows
        elif rows.untyped_storage().nbytes() == 0:  # freed by offload_states, not reloaded
            rows.untyped_storage().resize_(rows.numel() * rows.element_size())
        self.buffers_busy.add(key)
        return rows[:, :width]

    def _flush(self, key: GradKey | None = None) -> None:
        """Reduce-scatter the bucket of group `key` (all buckets by default).

        With overlap_comm one bucket is reduced while the next fills, as DeepSpeed's double
        buffer: the reductions launched before this one are finished once it is launched (they
        had a bucket's worth of backward to run in), so a backward holds at most two buckets
        and their results, whatever its size (it held every bucket until its end)."""
        overlap = self.coordinator.config.overlap_comm
        for k in [key] if key is not None else sorted(self.buckets, key=str):
            bucket = self.buckets.pop(k, None)
            if bucket is not None and bucket.entries:
                finish = bucket.reduce(self._deliver(), overlap=overlap)
                self._finish_reductions()
                self.reducing.append((k, finish))

    def _deliver(self) -> Deliver:
        """Where the shard group's (or node's) reductions go: node-local accumulation's held
        gradients, the sink, the replicas' held gradients, or the shards' ``.grad``."""
        if self.node_local is not None:
            return self.node_local.hold
        if self.sink is not None:
            return to_sink(self.sink)
        if self.replicas is not None:
            return self.replicas.hold
        return accumulate

    def _finish_reductions(self) -> None:
        reducing, self.reducing = self.reducing, []
        for key, finish in reducing:
            finish()
            self.buffers_busy.discard(key)

    def _start_backward(self) -> None:
        self.in_backward = True
        self.coordinator.in_backward = True
        if self.persistent is not None:  # released since the forward (empty_partition_cache)
            self.persistent.refresh()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.in_backward = False
        self.coordinator.in_backward = False
        self.forwards_pending = 0
        for unit in self.units:
            if self.late_gradients:
                keep_local(unit, self.sink)
            elif unit.ready:
                self._gradients_done(unit)  # the missing gradients count as zeros
        if self.requires_gradient_sync:
            self._queue_unsynced()
        self._flush()
        self._finish_reductions()
        self.channel.agree(Kind.END_BACKWARD, [])
        self.coordinator.release_all()  # waits for gathers in flight, from secondaries too
        self.coordinator.drop_secondaries()  # of units whose backward fetched nothing
        if self.requires_gradient_sync:
            self._reduce_across()

    def _queue_unsynced(self) -> None:
        """Queue the unsynced gradients of units this backward computed nothing for, in model
        order (the same on every rank)."""
        if not self.unsynced_units:
            return  # every backward with sync: nothing to look through
        for unit in [u for u in self.units if u in self.unsynced_units]:
            self._queue(unit)

    def _reduce_across(self) -> None:
        """The reduction's second stage, when this backward ends the accumulation: across the
        nodes (node-local accumulation; into the sink, if any) or the replicas (not with a
        sink: its owner all-reduces)."""
        if not self.requires_all_reduce:
            return
        if self.node_local is not None:
            self.node_local.finish(to_sink(self.sink) if self.sink is not None else _adopt)
        elif self.replicas is not None and self.sink is None:
            self.replicas.finish(_adopt)

    def sync_gradients(self) -> None:
        """Reduce what backward passes without gradient sync held, now (outside a backward)."""
        if not self.unsynced_units:
            return
        self._queue_unsynced()
        self._flush()
        self._finish_reductions()
        self._reduce_across()

    def drop_unsynced(self) -> None:
        """Forget the gradients held by backward passes without gradient sync, and those held
        for the reduction across nodes."""
        self.unsynced.clear()
        self.unsynced_units.clear()
        if self.node_local is not None:
            self.node_local.drop()

    # -- errors ----------------------------------------------------------------------------

    def diagnose(self, error: Exception) -> ZeroParamError | None:
        """Name the unavailable parameter behind an error raised inside a forward. Only the
        errors torch raises computing with an empty parameter (RuntimeError, IndexError) are
        looked at: an assertion or a user's own error is not about parameters."""
        if not self.stack:
            return None
        info = self.stack[-1]
        self.stack.clear()
        if not isinstance(error, (RuntimeError, IndexError)):
            return None
        rank = dist.get_rank() if dist.is_initialized() else 0
        for name, p in info.module.named_parameters():
            p = zero_params([p])[0]
            if getattr(p, "ds_status", None) is _NOT_AVAILABLE and not p.ds_persist:
                qualified = f"{info.name}.{name}" if info.name else name
                return ZeroParamError(
                    f"rank {rank}: module {info.name or '<root>'!r} "
                    f"({type(info.module).__name__}) failed while its parameter {qualified!r} "
                    f"is not available ({p.ds_summary()}); a parameter used outside the module "
                    "that owns it must be registered with register_external_parameter, or "
                    f"gathered with GatheredParameters. The error was: {error}"
                )
        return None


_F = TypeVar("_F", bound=Callable[..., Any])


def _adopt(unit: Unit, group: _GradGroup, reduced: torch.Tensor) -> None:
    """Add a reduction nobody else keeps to the shards' ``.grad`` (a `Deliver`)."""
    accumulate(unit, group, reduced, adopt=True)


def eager(hook: _F) -> _F:
    """`hook`, run eagerly under torch.compile (a graph break around it). Outside the
    compiler it is called straight: torch.compiler.disable's wrapper costs eight Python calls
    a call, 8 thousand a step for a model of 400 modules; `is_compiling` is one C call, and
    the compiler, tracing it as True, meets the disabled call instead."""
    disabled = torch.compiler.disable(hook)  # type: ignore[no-untyped-call]

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return hook(*args, **kwargs)

    return cast("_F", run)
