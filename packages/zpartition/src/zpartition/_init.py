"""`Init`: partition parameters while the model is built, so no rank ever holds all of it.

Inside the context every ``nn.Module`` subclass's ``__init__`` is wrapped; when the outermost
``__init__`` of a module returns (the most-derived class's, so parents' constructors still see
full parameters), that module's own parameters are made equal across ranks (rank 0's values,
broadcast; not with ``sync_module_states=False``) and cut into shards. Children were cut when
their own ``__init__`` returned, so at any moment at most one module's parameters exist in
full. ``nn.Module.apply`` gathers each module's parameters around the function it runs (rank
0's results kept), as DeepSpeed's, so a parent that initializes its children's weights in its
``__init__`` reaches them. Other writes after a child was cut (Hugging Face's ``post_init``,
with a recursion of its own) are gathered by a torch function mode while the context is
entered: see `_init_writes`. The wrappers are removed and the mode popped on exit.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zcomm
from zpartition._config import ZeroParamConfig
from zpartition._gather import channel_for, new_unit
from zpartition._gathered import GatheredParameters
from zpartition._host_heap import fix_mmap_threshold
from zpartition._hybrid import replicas_for
from zpartition._init_writes import let_go, start, stop, suspended
from zpartition._partitioned import convert_module
from zpartition._secondary import check_secondary_size
from zpartition._store import ShardStore

__all__ = ["Init"]

_active: list[Init] = []  # the Init contexts entered, innermost last
_wrapped: dict[type, Callable[..., None]] = {}  # class -> its own __init__, while patched
_saved_init_subclass: Any = None
_module_apply = nn.Module.apply


def _gathering(fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """`fn` run on each module with the module's partitioned parameters gathered, rank 0's
    results kept: a parent's ``self.apply(init_weights)`` in its ``__init__`` (Hugging Face's
    ``post_init``) finds its children already cut, and would write into empty tensors."""
    if getattr(fn, "_zp_gathering", False):  # apply recurses with the function it was given
        return fn

    @functools.wraps(fn)
    def run(module: nn.Module) -> None:
        params = [p for p in module.parameters(recurse=False) if hasattr(p, "ds_id")]
        with GatheredParameters(params, modifier_rank=0):
            fn(module)  # its writes to other modules' parameters: see _init_writes

    run._zp_gathering = True  # type: ignore[attr-defined]
    return run


def _apply(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    return _module_apply(self, _gathering(fn))


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    todo = [cls]
    while todo:
        sub: type
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


def _on_meta(kwargs: dict[str, Any]) -> bool:
    """Whether a module is built with ``device="meta"``: `torch.nn.utils.skip_init`'s way."""
    device = kwargs.get("device")
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "meta"


_on_meta_depth = 0  # modules being built inside one built on "meta" (see `_cut_after_to_empty`)


def _wrap(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or cls in _wrapped:
        return

    @functools.wraps(original)
    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        global _on_meta_depth
        depth = self.__dict__.get("_zp_init_depth", 0)
        meta = depth == 0 and _on_meta(kwargs)
        self.__dict__["_zp_init_depth"] = depth + 1
        _on_meta_depth += meta
        try:
            original(self, *args, **kwargs)
        finally:
            self.__dict__["_zp_init_depth"] = depth
            _on_meta_depth -= meta
        if depth == 0:
            del self.__dict__["_zp_init_depth"]
            if _active:
                let_go()  # what the __init__ wrote to parameters already cut is kept now
                if meta and not _on_meta_depth:
                    _cut_after_to_empty(self, _active[-1])
                elif not _on_meta_depth:
                    _active[-1]._partition(self)

    _wrapped[cls] = original
    cls.__init__ = init  # type: ignore[misc]


def _cut_after_to_empty(module: nn.Module, init: Init) -> None:
    """A module built on the "meta" device (``skip_init(cls, ...)`` is ``cls(...,
    device="meta").to_empty(device=...)``) has no values to cut, and ``to_empty`` replaces its
    parameters with new ones; so it and the modules built inside it are cut, by the `Init` it
    was built in, once its ``to_empty`` has run, as DeepSpeed's ``hook_for_skip_init``."""
    to_empty = module.to_empty

    @functools.wraps(to_empty)
    def run(*args: Any, **kwargs: Any) -> nn.Module:
        del module.__dict__["to_empty"]  # once: the class's own from now on
        built = to_empty(*args, **kwargs)
        for m in built.modules():
            init._partition(m)
        return built

    module.__dict__["to_empty"] = run


def _patch() -> None:
    global _saved_init_subclass
    for cls in _subclasses(nn.Module):
        _wrap(cls)
    _saved_init_subclass = nn.Module.__dict__.get("__init_subclass__")

    def init_subclass(cls: type[nn.Module], /, **kwargs: Any) -> None:
        super(nn.Module, cls).__init_subclass__(**kwargs)
        _wrap(cls)  # classes defined inside the context

    nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment,method-assign]
    nn.Module.apply = _apply  # type: ignore[assignment,method-assign]


def _unpatch() -> None:
    nn.Module.apply = _module_apply  # type: ignore[method-assign]
    for cls, original in _wrapped.items():
        cls.__init__ = original  # type: ignore[misc]
    _wrapped.clear()
    if _saved_init_subclass is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = _saved_init_subclass  # type: ignore[method-assign]


class Init:
    """Partition parameters as modules are built: ``with zpartition.Init(): model = Net()``.

    Args:
        module: an already built module to partition now (no context needed).
        data_parallel_group: the group to partition across (the world by default); with
            `replicate_group`, this rank's shard group.
        remote_device: ``"cpu"`` keeps the shards in host memory; ``None`` on the accelerator.
        pin_memory: pin host shards (with ``remote_device="cpu"`` on a CUDA machine).
        enabled: ``False`` makes the context do nothing.
        dtype: cast floating-point parameters to this dtype.
        sync_module_states: zstack's, not DeepSpeed's (FSDP's name for the same): ``True``
            broadcasts rank 0's freshly built values of each module before the cut, so every
            rank's shard comes from the same values, as DeepSpeed does. ``False`` skips that:
            each rank keeps its own slice of what it built, so the gathered parameters mix
            ranks' draws until they are overwritten. Use it when a checkpoint load overwrites
            every weight next (Transformers' ``no_init_weights()`` around the construction,
            then ``zengine.load_safetensors``): the broadcast was most of the construction's
            time. Writes after construction caught inside the context (`_init_writes`) keep
            rank 0's values either way, so the parameters they touch agree across ranks.
        replicate_group: zstack's (FSDP2's HSDP): hybrid sharding, the ranks holding the same
            chunks in the other shard groups. Each module's values are then global rank 0's
            (broadcast across it, then within the shard group), and writes after
            construction replica 0's. Pass the same group to `partition` (or zengine). The
            groups must form a grid of the world: `ZeroParamError` otherwise. See [Note:
            hybrid sharding]; `hybrid_groups` makes such a pair.
        shard_store: zstack's: where each module's shard goes as soon as it is cut (a
            `ShardStore`; zengine's ``zero.Init`` passes its NVMe store when the config's
            ``offload_param`` is on NVMe), so a model larger than host memory is built a
            module at a time; `partition` keeps the shards in the same store.
        config: the `ZeroParamConfig` the model will be partitioned with. Its
            ``secondary_partition_size`` (ZeRO++'s hpZ) is checked here as `partition` checks it
            (it must divide a node's ranks and the group's: `ZeroParamError`), so a bad one
            fails before the model is built; it changes nothing in how `Init` cuts: the
            secondary shards are kept by a partitioned model's forward passes ([Note:
            secondary partition]).

    zpartition reads no DeepSpeed config: zengine's ``zero.Init`` (DeepSpeed's
    ``deepspeed.zero.Init``) takes one, validates it as ``initialize`` does, and passes the
    dtype, groups, `ZeroParamConfig` and NVMe store it sets here.

    Where the shards live in host memory (no CUDA, or ``remote_device="cpu"``), entering the
    outermost context fixes glibc's mmap threshold at 128 KiB for the rest of the process, so
    the freed whole modules do not stay resident in the heap (see `_host_heap`).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: dist.ProcessGroup | None = None,
        remote_device: str | torch.device | None = None,
        pin_memory: bool = False,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        sync_module_states: bool = True,
        replicate_group: dist.ProcessGroup | None = None,
        shard_store: ShardStore | None = None,
        config: ZeroParamConfig | None = None,
    ) -> None:
        if config is not None and not isinstance(config, ZeroParamConfig):
            raise TypeError(
                f"Init(config=...): expected a zpartition.ZeroParamConfig, got "
                f"{type(config).__name__} (a DeepSpeed config goes to zengine.zero.Init)"
            )
        self.enabled = enabled
        self.shard_store = shard_store
        self.sync = sync_module_states
        self.group = data_parallel_group
        self.pin_memory = pin_memory
        self.dtype = dtype
        if remote_device not in (None, "cpu", "none") and not isinstance(
            remote_device, torch.device
        ):
            raise ValueError(
                f"Init(remote_device={remote_device!r}): expected None or 'cpu' "
                "(NVMe parameter offload is zengine's offload_param)"
            )
        self.remote_device = (
            None
            if remote_device is None or remote_device == "none"
            else torch.device(remote_device)
        )
        if enabled and not dist.is_initialized():
            zcomm.init_distributed()
        self.replicate = replicas_for(self.group, replicate_group) if enabled else None
        if enabled and config is not None:
            check_secondary_size(config.secondary_partition_size, dist.get_world_size(self.group))
        if module is not None and enabled:
            self._fix_host_heap()
            for m in module.modules():
                self._partition(m)

    def __enter__(self) -> Init:
        if self.enabled:
            if not _active:
                self._fix_host_heap()
                _patch()
                start()  # the write mode: see _init_writes
            _active.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        _active.remove(self)
        if not _active:
            try:
                stop(exc_type)
            finally:
                _unpatch()

    def _fix_host_heap(self) -> None:
        """Fix glibc's mmap threshold where the shards live in host memory (see `_host_heap`)."""
        host = (
            self.remote_device.type == "cpu"
            if self.remote_device is not None
            else not torch.cuda.is_available()
        )
        if host:
            fix_mmap_threshold()

    def _partition(self, module: nn.Module) -> None:
        with suspended():  # the cut is zpartition's own work, not a write
            self._cut(module)

    def _cut(self, module: nn.Module) -> None:
        compute = zcomm.get_accelerator().device() if torch.cuda.is_available() else None
        for p in module.parameters(recurse=False):
            if compute is not None and not hasattr(p, "ds_id"):
                p.data = p.data.to(compute)
        params = convert_module(
            module,
            group=self.group,
            recurse=False,
            shard_device=self.remote_device,
            dtype=self.dtype,
            pin_memory=self.pin_memory and self.remote_device is not None,
            sync=self.sync,
            replicate=self.replicate,
        )
        if not params:
            return
        channel = channel_for(self.group)
        unit = new_unit(
            channel.next_unit_id(),
            type(module).__name__,
            params,
            channel,
            params[0].device,
            self.replicate,
        )
        if self.shard_store is not None:  # away at once: the model is never whole in memory
            unit.store = self.shard_store
            unit.put_away()
