"""DeepSpeed config keys for features zengine does not have, and what a config holding one gets.

[Note: DeepSpeed keys without a feature]
DeepSpeed configs carry sections for features a run does not use (``"tensorboard": {"enabled":
false}``, ``"zero_quantized_weights": false``): a drop-in engine has to take such a config as it
is, and still never train differently from what the config asks without saying so. Each key
below is set aside before validation, by what its value asks for:

- nothing (the feature off, or DeepSpeed's default): dropped without a word;
- a report only (loggers, profilers, the autotuner): dropped with a warning that zengine does
  not produce it; the training is the same without it;
- a different training (quantized or hierarchical communication, a partial offload, fp32
  all-reduce, ...): a config error naming the key and the value that would turn it off.

DeepSpeed's deprecated ``cpu_offload`` and ``cpu_offload_param`` switches are read as the
sections that replaced them, as DeepSpeed reads them, with a warning. A key that is in neither
DeepSpeed nor zengine stays an unknown key, with the closest valid one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from zengine._config._errors import dotted, show
from zengine._config._sections import as_switch

__all__ = ["SetAside", "keys_at", "set_aside"]


def _off(value: object) -> bool:
    """A section whose ``enabled`` is not true (or that says nothing), or a false flag."""
    if isinstance(value, Mapping):
        return value.get("enabled") is not True
    return value is None or value is False


def _is(*inert: object) -> Callable[[object], bool]:
    """The value is one of `inert` (DeepSpeed's default or "off"), or null; a switch may be
    written 0 or 1 (as the config's own switches), a number is not a switch."""

    def same(value: object, v: object) -> bool:
        if isinstance(v, bool):
            return as_switch(value) is v
        return value == v and not isinstance(value, bool)

    return lambda value: value is None or any(same(value, v) for v in inert)


def _empty(value: object) -> bool:
    return value is None or value == {}


def _nothing_true(value: object) -> bool:
    """No flag in the section (at any depth) is true."""
    if isinstance(value, Mapping):
        return all(_nothing_true(v) for v in value.values())
    return value is not True


def _anything(value: object) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class _Key:
    path: tuple[str, ...]
    what: str  # DeepSpeed's feature, as the messages name it
    inert: Callable[[object], bool]  # the value asks for nothing
    off: str = ""  # what to write instead, for the error message
    report: bool = False  # a report only: warn and go on
    said: str = ""  # the report's words, when "which zengine does not produce" is not right


_ZERO, _OPT = "zero_optimization", ("zero_optimization", "offload_optimizer")

_KEYS = (
    # reports: the training is the same without them
    _Key(("tensorboard",), "TensorBoard logging", _off, report=True),
    _Key(("wandb",), "Weights & Biases logging", _off, report=True),
    _Key(("csv_monitor",), "CSV logging", _off, report=True),
    _Key(("comet",), "Comet logging", _off, report=True),
    _Key(("comms_logger",), "communication logger", _off, report=True),
    _Key(("flops_profiler",), "FLOPs profiler", _off, report=True),
    _Key(("memory_breakdown",), "memory breakdown", _off, report=True),
    _Key(("dump_state",), "state dump", _off, report=True),
    _Key(("autotuning",), "autotuner", _off, report=True),
    _Key(("timers",), "throughput timers", _nothing_true, report=True),
    _Key(
        ("activation_checkpointing",),
        "activation checkpointing settings",
        _nothing_true,
        report=True,
        said="the engine does not read it, as DeepSpeed's does not; "
        "zengine.checkpointing.configure(None, deepspeed_config=config) does",
    ),
    _Key(("sparse_attention",), "sparse attention kernels", _empty, report=True),
    # the same training whatever the value
    _Key(("local_rank",), "the launcher's rank", _anything),  # DeepSpeed's examples set it
    _Key((_ZERO, "memory_efficient_linear"), "ZeRO-3 linear layer", _anything),
    _Key((_ZERO, "log_trace_cache_warnings"), "trace cache warnings", _anything),
    _Key((_ZERO, "use_all_reduce_for_fetch_params"), "all-reduce parameter fetches", _anything),
    _Key(
        (_ZERO, "stage3_use_all_reduce_for_fetch_params"), "all-reduce parameter fetches", _anything
    ),
    _Key((_ZERO, "allgather_sequential"), "one all-gather per parameter", _anything),
    # zpartition's GatheredParameters without a modifier always checks for changes (and
    # raises DiscardedChangeError on every rank), the check this switch turns on in DeepSpeed
    _Key((_ZERO, "enable_sanity_checks"), "GatheredParameters' change check", _anything),
    # stages 1-2: DeepSpeed's choice of one all-reduce or a reduce per rank for a bucket
    _Key((_ZERO, "use_multi_rank_bucket_allreduce"), "one all-reduce per bucket", _anything),
    _Key((_ZERO, "save_muon_momentum_buffer_in_memory"), "Muon's buffer kept in memory", _anything),
    # DeepSpeed loads its checkpoints rank after rank to bound host memory; zstack's loads map
    # the files and each rank reads only its own pieces, so the bound holds either way
    _Key((_ZERO, "pipeline_loading_checkpoint"), "rank-by-rank checkpoint loading", _anything),
    _Key((_ZERO, "stage3_allgather_sequential"), "one all-gather per parameter", _anything),
    _Key((_ZERO, "cpu_offload_use_pin_memory"), "old pin_memory key", _anything),
    _Key((_ZERO, "override_module_apply"), "module.apply wrapper", _anything),
    _Key(("optimizer", "torch_adam"), "torch_adam outside optimizer.params", _anything),
    _Key(("bf16", "immediate_grad_update"), "immediate gradient updates", _anything),
    _Key(("bfloat16", "immediate_grad_update"), "immediate gradient updates", _anything),
    # another training: refused unless off
    _Key(("fp32_allreduce",), "fp32 all-reduce", _is(False), "false"),
    _Key(("disable_allgather",), "disabled all-gathers", _is(False), "false"),
    _Key(("sparse_gradients",), "sparse embedding gradients", _is(False), "false"),
    _Key(("amp",), "apex AMP", _off, '"enabled": false; use "fp16" or "bf16"'),
    _Key(("compression_training",), "compression training", _empty, "{}"),
    _Key(("data_efficiency",), "data efficiency", _off, '"enabled": false'),
    _Key(("curriculum_learning",), "curriculum learning", _off, '"enabled": false'),
    _Key(("elasticity",), "elastic training", _off, '"enabled": false'),
    _Key(("nebula",), "Nebula checkpoint service", _off, '"enabled": false'),
    _Key(("hybrid_engine",), "hybrid engine", _off, '"enabled": false'),
    _Key(("compile",), "DeepCompile", _nothing_true, "false flags"),
    _Key(("fp16", "fp16_master_weights_and_grads"), "fp16 masters", _is(False), "false"),
    *(
        _Key((section, key), what, _is(False), "false")
        for section in ("bf16", "bfloat16")
        for key, what in (
            ("bf16_master_weights_and_grads", "bf16 masters and gradients"),
            ("bf16_optimizer_states", "bf16 optimizer states"),
        )
    ),
    _Key((_ZERO, "legacy_stage1"), "legacy stage 1", _is(False), "false"),
    _Key((_ZERO, "zeropp_loco_param"), "ZeRO++ LoCo", _empty, "null"),
    _Key((_ZERO, "zenflow"), "ZenFlow (optimizer steps overlapped with training)", _is(), "null"),
    _Key((*_OPT, "ratio"), "partial optimizer offload", _is(1, 1.0), "1.0"),
)


_OLD_SWITCHES = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
"""DeepSpeed's deprecated ZeRO switches and the sections that replaced them: DeepSpeed still
reads ``true`` as that section with ``"device": "cpu"``, and so does zengine, with a warning."""


def _read_old_switches(out: SetAside) -> None:
    zero = out.data.get(_ZERO)
    if not isinstance(zero, Mapping) or not zero.keys() & _OLD_SWITCHES.keys():
        return
    zero = out.data[_ZERO] = dict(zero)
    for old, new in _OLD_SWITCHES.items():
        if old not in zero:
            continue
        value, where = as_switch(zero.pop(old)), dotted([_ZERO, old])
        if value is None or value is False:
            continue
        if value is not True:
            out.problems.append(f"{where}: expected true or false, got {show(value)}")
        elif zero.get(new) not in (None, {}):
            out.problems.append(
                f"{where}: DeepSpeed's old switch for {dotted([_ZERO, new])}, which the config "
                f"also sets; remove {old}"
            )
        else:
            zero[new] = {"device": "cpu"}
            out.reports.append(
                f'{where}: DeepSpeed\'s old switch, read as "{new}": {{"device": "cpu"}}; '
                "write that instead"
            )


def keys_at(path: tuple[str, ...]) -> list[str]:
    """The keys of features zengine does not have in the section at `path` (for suggestions:
    a misspelt one is still an unknown key, with its right spelling)."""
    old = list(_OLD_SWITCHES) if path == (_ZERO,) else []
    return [key.path[-1] for key in _KEYS if key.path[:-1] == path] + old


@dataclasses.dataclass
class SetAside:
    """What `set_aside` took out of a config."""

    data: dict[Any, Any]  # the config without those keys
    problems: list[str]  # keys asking for another training: config errors
    reports: list[str]  # keys asking for a report zengine does not make: warnings


def _sum_without(out: SetAside) -> None:
    """DeepSpeed's own refusals of ``gradient_allreduce_op: "sum"`` beside ZenFlow or
    DeepCompile, in its words: a config written for DeepSpeed learns the same there and here
    (where the two features are refused as well, below)."""
    if str(out.data.get("gradient_allreduce_op", "")).lower() != "sum":
        return
    zero, compile_ = out.data.get(_ZERO), out.data.get("compile")
    if isinstance(zero, Mapping) and zero.get("zenflow") is not None:
        out.problems.append('gradient_allreduce_op "sum" is not supported with ZenFlow')
    if isinstance(compile_, Mapping) and compile_.get("deepcompile"):
        out.problems.append('gradient_allreduce_op "sum" is not supported with DeepCompile')


def set_aside(data: Mapping[Any, Any]) -> SetAside:
    """Take the DeepSpeed keys of features zengine does not have out of `data` (a copy; the
    sections on their paths are copied too), sorted as the Note says."""
    out = SetAside(dict(data), [], [])
    _read_old_switches(out)
    _sum_without(out)
    for key in _KEYS:
        section: dict[Any, Any] = out.data
        for name in key.path[:-1]:
            inner = section.get(name)
            if not isinstance(inner, Mapping):
                break  # not there, or not a section: validation reports what is wrong
            copy = dict(inner)
            section[name] = copy
            section = copy
        else:
            if key.path[-1] not in section:
                continue
            value = section.pop(key.path[-1])
            if key.inert(value):
                continue
            where = dotted(list(key.path))
            if key.report:
                said = key.said or f"DeepSpeed's {key.what}, which zengine does not produce"
                out.reports.append(f"{where}: {said}; ignored")
            else:
                out.problems.append(
                    f"{where}: DeepSpeed's {key.what}, which zengine does not implement "
                    f"(got {show(value)}); remove the key or set it to {key.off}"
                )
    return out
