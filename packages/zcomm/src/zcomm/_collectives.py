"""The collectives, with one calling convention: tensors first, then keyword-only ``op``,
``group`` and ``async_op``; every call returns a `Handle`.

Each is the torch.distributed collective of the same name, never a reimplementation. A group
of one takes a fast path with no communication. On gloo, ``ReduceOp.AVG`` runs as a sum and a
division, because gloo in older torch releases rejects AVG. Host tensors on an NCCL group go
through device copies ([Note: host tensors on NCCL]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist

from zcomm._checks import check_group, check_rank, check_same_kind, check_tensor
from zcomm._handle import Handle, completed, run
from zcomm._world import group_size

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "inference_all_reduce",
    "reduce",
    "reduce_scatter_tensor",
]

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor collectives (the old names warn); use whichever exists.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _staging_device(
    group: dist.ProcessGroup | None, tensors: Sequence[torch.Tensor]
) -> torch.device | None:
    """[Note: host tensors on NCCL] NCCL carries CUDA tensors only, and zstack keeps state on
    the host that meets NCCL groups: ZeRO-Offload's gradient partitions (their norm, summed
    across ranks every step), flags and headers built on the CPU. torch would refuse such a
    collective ("No backend type associated with device type cpu"). Rather than every caller
    minding the backend, a collective whose tensors lie on the host while its group is NCCL's
    runs on device copies of them, and what it wrote is copied back when it completes
    (`_staged`). This is the device to copy to, or None when the tensors can go as they are
    (a world with a gloo backend for the CPU, "cpu:gloo,cuda:nccl", reports no "nccl" here and
    sends them over gloo). Host tensors on NCCL are small or rare; device tensors, the hot path,
    are let through by `_staged` before this is asked."""
    if not any(t.is_cpu for t in tensors) or dist.get_backend(group) != "nccl":
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _staged(
    op: str,
    group: dist.ProcessGroup | None,
    tensors: Sequence[torch.Tensor],
    written: Sequence[int],
    call: Callable[[list[torch.Tensor]], Handle],
    async_op: bool,
) -> Handle | None:
    """When `tensors` must go through the device ([Note: host tensors on NCCL]): `call` (the
    same collective) on device copies of them, and the copies of those at the indexes
    `written` copied back into them once it completed. None when they can go as they are."""
    for tensor in tensors:
        if tensor.is_cpu:
            break
    else:
        return None  # device tensors, the hot path on a GPU: no further call
    device = _staging_device(group, tensors)
    if device is None:
        return None
    copies = [t.to(device, copy=True) for t in tensors]
    inner = call(copies)

    def copy_back() -> None:
        for i in written:
            tensors[i].copy_(copies[i])

    # the inner handle stands in for torch's Work: waiting on this one waits on it first
    handle = Handle(op, group, cast(dist.Work, inner), finish=copy_back)
    if not async_op:
        handle.wait()
    return handle


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _emulated_avg(op: object, group: dist.ProcessGroup | None) -> bool:
    return op == ReduceOp.AVG and dist.get_backend(group) == "gloo"


def _average(tensor: torch.Tensor, size: int) -> Callable[[], None]:
    def divide() -> None:
        if tensor.is_floating_point():
            tensor.div_(size)

    return divide


def _reduction(
    op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None, tensor: torch.Tensor, size: int
) -> tuple[dist.ReduceOp.RedOpType, Callable[[], None] | None]:
    """The op torch runs for `op`, and what to do to `tensor` after (gloo's AVG: a sum, then a
    division by `size`)."""
    if _emulated_avg(op, group):
        return ReduceOp.SUM, _average(tensor, size)
    return op, None


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Reduce `tensor` across `group` in place with `op` (SUM by default)."""
    check_tensor("all_reduce", "tensor", tensor)
    size = group_size("all_reduce", check_group("all_reduce", group))
    if size == 1:
        return completed("all_reduce")
    staged = _staged(
        "all_reduce",
        group,
        (tensor,),
        (0,),
        lambda c: all_reduce(c[0], op, group, async_op),
        async_op,
    )
    if staged is not None:
        return staged
    torch_op, finish = _reduction(op, group, tensor, size)
    return run(
        "all_reduce",
        group,
        lambda a: dist.all_reduce(tensor, op=torch_op, group=group, async_op=a),
        async_op=async_op,
        nbytes=_nbytes(tensor),
        finish=finish,
        sliced=tensor.is_cpu,
    )


def inference_all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> None:
    """DeepSpeed's all-reduce for inference (``op`` positional, as there): `tensor` reduced in
    place across `group` before it returns. DeepSpeed's CPU shared-memory kernel for it is not
    here: this is `all_reduce`, waited on."""
    all_reduce(tensor, op=op, group=group).wait()


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Reduce `tensor` across `group` with `op` into global rank `dst`'s `tensor`; the other
    ranks' `tensor` is left as torch.distributed leaves it (unspecified)."""
    check_tensor("reduce", "tensor", tensor)
    size = group_size("reduce", check_group("reduce", group))
    check_rank("reduce", "dst", dst, group)
    if size == 1:
        return completed("reduce")
    staged = _staged(
        "reduce", group, (tensor,), (0,), lambda c: reduce(c[0], dst, op, group, async_op), async_op
    )
    if staged is not None:
        return staged
    torch_op, finish = _reduction(op, group, tensor, size)
    return run(
        "reduce",
        group,
        lambda a: dist.reduce(tensor, dst, op=torch_op, group=group, async_op=a),
        async_op=async_op,
        nbytes=_nbytes(tensor),
        finish=finish,
        sliced=tensor.is_cpu,
    )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Copy `tensor` from global rank `src` to every rank of `group`, in place."""
    check_tensor("broadcast", "tensor", tensor)
    size = group_size("broadcast", check_group("broadcast", group))
    check_rank("broadcast", "src", src, group)
    if size == 1:
        return completed("broadcast")
    staged = _staged(
        "broadcast",
        group,
        (tensor,),
        (0,),
        lambda c: broadcast(c[0], src, group, async_op),
        async_op,
    )
    if staged is not None:
        return staged
    return run(
        "broadcast",
        group,
        lambda a: dist.broadcast(tensor, src, group=group, async_op=a),
        async_op=async_op,
        nbytes=_nbytes(tensor),
        sliced=tensor.is_cpu,
    )


def _check_pair(
    op: str, small: torch.Tensor, big: torch.Tensor, names: tuple[str, str], size: int
) -> None:
    check_same_kind(op, names[0], small, names[1], big)
    if big.numel() != small.numel() * size:
        raise ValueError(
            f"{op}: {names[1]} has {big.numel()} elements, expected "
            f"{names[0]}.numel() * group size = {small.numel()} * {size} = {small.numel() * size}"
        )
    for name, tensor in zip(names, (small, big), strict=True):
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")


def _prepare_pair(
    op: str,
    small: torch.Tensor,
    big: torch.Tensor,
    names: tuple[str, str],
    group: dist.ProcessGroup | None,
    *,
    result: torch.Tensor,
) -> int:
    """Check the shard and the full tensor of `op` and return the group size; in a group of
    one the answer is the input itself, copied into `result` here."""
    check_tensor(op, names[1], big)
    check_tensor(op, names[0], small)
    size = group_size(op, check_group(op, group))
    _check_pair(op, small, big, names, size)
    if size == 1:
        source = small if result is big else big
        if result.data_ptr() != source.data_ptr():
            result.view(-1).copy_(source.view(-1))
    return size


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Gather every rank's `tensor` into `tensor_list`, one tensor per rank of `group` in
    rank order (torch's and DeepSpeed's list form; `all_gather_into_tensor` gathers into one
    flat tensor)."""
    check_tensor("all_gather", "tensor", tensor)
    size = group_size("all_gather", check_group("all_gather", group))
    if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != size:
        got = len(tensor_list) if isinstance(tensor_list, (list, tuple)) else tensor_list
        raise ValueError(
            f"all_gather: tensor_list must hold {size} tensors (the group size), got {got!r}"
        )
    for i, out in enumerate(tensor_list):
        check_tensor("all_gather", f"tensor_list[{i}]", out)
        check_same_kind("all_gather", f"tensor_list[{i}]", out, "tensor", tensor)
        if out.shape != tensor.shape:
            raise ValueError(
                f"all_gather: tensor_list[{i}] has shape {tuple(out.shape)}, tensor has "
                f"{tuple(tensor.shape)}"
            )
    if size == 1:
        if tensor_list[0].data_ptr() != tensor.data_ptr():
            tensor_list[0].copy_(tensor)
        return completed("all_gather")
    staged = _staged(
        "all_gather",
        group,
        (tensor, *tensor_list),
        range(1, size + 1),
        lambda c: all_gather(c[1:], c[0], group, async_op),
        async_op,
    )
    if staged is not None:
        return staged
    return run(
        "all_gather",
        group,
        lambda a: dist.all_gather(list(tensor_list), tensor, group=group, async_op=a),
        async_op=async_op,
        nbytes=_nbytes(tensor) * size,
        sliced=tensor.is_cpu,
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Gather every rank's `input_tensor` into `output_tensor`, in rank order.

    Like torch, the two tensors come positionally (output first); `output_tensor` holds
    group size times as many elements as `input_tensor`.
    """
    op = "all_gather_into_tensor"
    names = ("input_tensor", "output_tensor")
    size = _prepare_pair(op, input_tensor, output_tensor, names, group, result=output_tensor)
    if size == 1:
        return completed(op)
    staged = _staged(
        op,
        group,
        (output_tensor, input_tensor),
        (0,),
        lambda c: all_gather_into_tensor(c[0], c[1], group, async_op),
        async_op,
    )
    if staged is not None:
        return staged
    return run(
        op,
        group,
        lambda a: _all_gather_single(output_tensor, input_tensor, group=group, async_op=a),
        async_op=async_op,
        nbytes=_nbytes(output_tensor),
        sliced=output_tensor.is_cpu,
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle:
    """Send the r-th of `input`'s equal chunks (along dim 0) to rank r of `group`, and receive
    rank r's chunk for this rank into the r-th chunk of `output`.

    torch's ``all_to_all_single`` with equal splits only; `group` and `async_op` are keywords,
    so that torch's positional split sizes fail here rather than mean a group. `output` and
    `input` have one shape, whose first dimension the group size divides.
    """
    op = "all_to_all_single"
    check_tensor(op, "output", output)
    check_tensor(op, "input", input)
    size = group_size(op, check_group(op, group))
    check_same_kind(op, "output", output, "input", input)
    if output.shape != input.shape:
        raise ValueError(
            f"{op}: output has shape {tuple(output.shape)}, input has {tuple(input.shape)}; "
            "equal splits need one shape"
        )
    if input.dim() == 0 or input.shape[0] % size:
        raise ValueError(
            f"{op}: input's first dimension must split into group size = {size} equal chunks, "
            f"got shape {tuple(input.shape)}"
        )
    for name, tensor in (("output", output), ("input", input)):
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
    if size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return completed(op)
    start, end = output.data_ptr(), output.data_ptr() + _nbytes(output)
    if start < input.data_ptr() + _nbytes(input) and input.data_ptr() < end:
        raise ValueError(f"{op}: output overlaps input (chunks would be overwritten unsent)")
    staged = _staged(
        op,
        group,
        (output, input),
        (0,),
        lambda c: all_to_all_single(c[0], c[1], group=group, async_op=async_op),
        async_op,
    )
    if staged is not None:
        return staged
    return run(
        op,
        group,
        lambda a: dist.all_to_all_single(output, input, group=group, async_op=a),
        async_op=async_op,
        nbytes=_nbytes(input),
        sliced=input.is_cpu,
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    scratch_input: bool = False,
) -> Handle:
    """Reduce `input` across `group` with `op` and keep this rank's slice in `output`.

    `input` holds group size times as many elements as `output`; rank r receives the r-th
    contiguous chunk of the reduction. With `scratch_input` the caller is done with `input`
    and lets the collective overwrite it, which on gloo saves a copy of it (see `_scatter`);
    `output` may then be this rank's chunk of `input` itself (in place, as NCCL defines it),
    which saves the output's memory too.
    """
    name = "reduce_scatter_tensor"
    size = _prepare_pair(name, output, input, ("output", "input"), group, result=output)
    if size == 1:
        return completed(name)
    _check_overlap(name, output, input, group, scratch_input)
    # staged, the copies lie apart: a scratch input's chunk is no longer the output
    staged = _staged(
        name,
        group,
        (output, input),
        (0,),
        lambda c: reduce_scatter_tensor(c[0], c[1], op, group, async_op),
        async_op,
    )
    if staged is not None:
        return staged
    return _scatter(
        name,
        output,
        input,
        op=op,
        group=group,
        async_op=async_op,
        size=size,
        scratch=scratch_input,
    )


def _check_overlap(
    op: str,
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    scratch: bool,
) -> None:
    """`output` and `input` apart, or `output` exactly this rank's chunk of a scratch input."""
    start, end = output.data_ptr(), output.data_ptr() + _nbytes(output)
    if end <= input.data_ptr() or input.data_ptr() + _nbytes(input) <= start:
        return
    if scratch and start == input.data_ptr() + dist.get_rank(group) * _nbytes(output):
        return
    raise ValueError(
        f"{op}: output overlaps input; only this rank's chunk of input can be the output, "
        "and only with scratch_input=True (an in-place reduce-scatter)"
    )


def _scatter(
    name: str,
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None,
    async_op: bool,
    size: int,
    scratch: bool = False,
) -> Handle:
    """The reduce-scatter itself, unchecked, recorded under `name`.

    gloo's reduce-scatter copies its whole input and takes about twice an all-reduce's time
    (measured on 2 CPU ranks, 4-256 MiB fp32: 7.5-425 ms against 4.8-232 ms, plus the copy's
    memory). So on gloo, where the caller lets `input` be overwritten (`scratch`), it is
    all-reduced in place and this rank's chunk copied out: more bytes on the wire, less time
    and no copy of the input."""
    finishers: list[Callable[[], None]] = []
    torch_op = op
    if _emulated_avg(op, group):
        finishers.insert(0, _average(output, size))
        torch_op = ReduceOp.SUM
    in_place = scratch and dist.get_backend(group) == "gloo"
    if in_place:
        n = output.numel()
        mine = input.view(-1)[dist.get_rank(group) * n :][:n]

        def copy_out() -> None:
            if output.data_ptr() != mine.data_ptr():  # else reduced in place already
                output.view(-1).copy_(mine)

        finishers.insert(0, copy_out)

    def finish() -> None:
        for f in finishers:
            f()

    return run(
        name,
        group,
        (lambda a: dist.all_reduce(input, op=torch_op, group=group, async_op=a))
        if in_place
        else (
            lambda a: _reduce_scatter_single(output, input, op=torch_op, group=group, async_op=a)
        ),
        async_op=async_op,
        nbytes=_nbytes(input),
        finish=finish if finishers else None,
        sliced=input.is_cpu,
    )


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Block until every rank of `group` has reached this call."""
    if group_size("barrier", check_group("barrier", group)) == 1:
        return
    run(
        "barrier",
        group,
        lambda a: dist.barrier(group=group, async_op=a),
        async_op=False,
        nbytes=0,
        sliced=dist.get_backend(group) == "gloo",
    )
