"""One batch of a schedule on one stage: each instruction's handler, and what it leaves behind.

State is kept per (micro-batch, chunk) in a `_Slot`, not per buffer id: a schedule's buffer
ids only say which slots may be live at once, and keying by the micro-batch makes a slot's
contents impossible to mix up. A slot is dropped once nothing later reads it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.utils import _pytree as pytree

import zpipe
from zengine._engine import half_floats
from zengine._optim import FlatLayout, forward_autocast
from zengine.pipe._errors import PipelineError, describe
from zengine.pipe._link import Link, frame_size
from zengine.pipe._module import PipelineModule
from zengine.pipe._payload import unflatten
from zengine.pipe._split import SplitBackward

__all__ = ["BatchRun", "StageContext"]

_I = TypeVar("_I", bound=zpipe.PipeInstruction)
_Handler = Callable[[zpipe.PipeInstruction], None]
_Receive = zpipe.RecvActivation | zpipe.RecvGrad


def _handles(
    kind: type[_I], handler: Callable[[_I], None]
) -> tuple[type[zpipe.PipeInstruction], _Handler]:
    """`handler` filed under `kind`: `BatchRun._handler` finds it by an instruction's class, so
    it is only ever called with a `kind` (or a subclass), whatever the dict's type says."""
    return kind, cast(_Handler, handler)


# the computations whose seconds `PipelineEngine.compute_times` records
_KINDS: dict[type[zpipe.PipeInstruction], str] = {
    zpipe.ForwardPass: "F",
    zpipe.BackwardPass: "B",
    zpipe.BackwardInputPass: "I",
    zpipe.BackwardWeightPass: "W",
}


@dataclass
class _Slot:
    """One micro-batch on one chunk of this stage."""

    # a micro-batch's data are the caller's: any nest of tensors and other values (a pytree)
    inputs: Any = None  # what the forward takes: loaded, or received (float leaves need grad)
    in_floats: list[torch.Tensor] = field(default_factory=list)  # received float tensors
    labels: Any = None  # on the last virtual stage
    outputs: Any = None  # the forward's output (the loss on the last virtual stage)
    out_floats: list[torch.Tensor] = field(default_factory=list)  # its float tensors
    out_grads: list[torch.Tensor] | None = None  # their gradients, received
    input_grads: list[torch.Tensor] | None = None  # to send upstream
    split: SplitBackward | None = None  # between BackwardInputPass and BackwardWeightPass
    backward_done: bool = False  # the weight gradients are in
    grads_sent: bool = False  # the input gradients have gone upstream


@dataclass(frozen=True)
class StageContext:
    """What a batch's run needs of its stage, read from the engine when the batch starts."""

    stage: int  # this stage's id
    virtual_stages: int  # stages times chunks per stage
    device: torch.device
    module: PipelineModule
    layout: FlatLayout  # the optimizer's: tied gradients, the reduction, folding
    link: Link  # activations and gradients to and from the other stages
    autocast: torch.dtype | None  # torch_autocast's dtype, None when off
    half_inputs: bool  # fp16 with auto_cast: the first stage's float inputs are cast
    inputs_need_grad: bool  # reentrant activation checkpointing: the first stage's inputs too
    loss_factor: float  # the last stage's loss times this before its backward
    computes_loss: bool  # the last stage computes the loss (eval_batch's compute_loss)
    receive_ahead: bool  # post receives as soon as their size is known (`Link.post_ahead`)
    compute_times: dict[str, list[float]] | None  # where each computation's seconds go
    chunk_parameters: Callable[[int], list[nn.Parameter]]  # what a chunk's backward reaches
    optimizer_step: Callable[[], None]  # the OptimizerStep instruction


def _floats(payload: object) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves(payload)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


class BatchRun:
    """Runs `schedule`'s instructions for one batch (training when `train`)."""

    def __init__(
        self,
        context: StageContext,
        schedule: zpipe.PipeSchedule,
        data_iter: Iterator[Any] | None,
        *,
        train: bool,
    ) -> None:
        self.context = ctx = context
        self.schedule = schedule
        self.data_iter = data_iter
        self.train = train
        self.stage = ctx.stage
        self.last = ctx.virtual_stages - 1  # the last virtual stage
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.batches: dict[int, Any] = {}  # micro-batch -> what data_iter gave, until loaded
        # how many loads of each micro-batch this stage makes: one for the first virtual
        # stage's inputs and one for the last's labels, when this stage holds them
        self.loads = sum(int(schedule.owner(v)[0]) == self.stage for v in {0, self.last})
        self.loaded: dict[int, int] = {}  # micro-batch -> loads made
        # micro-batch -> loss (last stage); None: a schedule without micro-batch ids
        self.losses: dict[int | None, torch.Tensor] = {}
        self.outputs: dict[int | None, Any] = {}  # micro-batch -> output (last stage, eval)
        self.handlers: dict[type[zpipe.PipeInstruction], _Handler] = dict(
            [
                _handles(zpipe.LoadMicroBatch, self.load),
                _handles(zpipe.ForwardPass, self.forward),
                _handles(zpipe.BackwardPass, self.backward),
                _handles(zpipe.BackwardInputPass, self.backward_input),
                _handles(zpipe.BackwardWeightPass, self.backward_weight),
                _handles(zpipe.SendActivation, self.send_activation),
                _handles(zpipe.RecvActivation, self.recv_activation),
                _handles(zpipe.SendGrad, self.send_grad),
                _handles(zpipe.RecvGrad, self.recv_grad),
                _handles(
                    zpipe.ReduceTiedGrads,
                    lambda _: ctx.module.allreduce_tied_grads(ctx.layout.accumulated_grad),
                ),
                _handles(zpipe.ReduceGrads, lambda _: ctx.layout.after_backward(True)),
                _handles(zpipe.OptimizerStep, lambda _: ctx.optimizer_step()),
            ]
        )

    # -- the loop ------------------------------------------------------------------------------

    def execute(self) -> None:
        """Run every instruction; on failure tell the other stages, and raise naming this
        stage and the instruction."""
        link, times = self.context.link, self.context.compute_times
        program = [(step, cmd) for step, cmds in enumerate(self.schedule) for cmd in cmds]
        receives = self._receives(program) if self.context.receive_ahead else {}
        for at, (step, cmd) in enumerate(program):
            handler = self._handler(type(cmd))
            try:
                if handler is None:
                    raise TypeError(f"no handler for {type(cmd).__name__} instructions")
                with torch.set_grad_enabled(self.train):
                    start = time.perf_counter()
                    handler(cmd)
                    if times is not None and type(cmd) in _KINDS:
                        times.setdefault(_KINDS[type(cmd)], []).append(time.perf_counter() - start)
                    self._post_ahead(at, receives)
            except PipelineError as error:
                # already names the stage that failed
                link.abort(str(error), self._expected([c for _, c in program[at:]]))
                raise
            except Exception as error:
                text = (
                    f"stage {self.stage} failed in {describe(cmd)} (step {step}): "
                    f"{type(error).__name__}: {error}"
                )
                link.abort(text, self._expected([c for _, c in program[at:]]))
                raise PipelineError(text, stage=self.stage, instruction=describe(cmd)) from error
        link.drain()

    # -- receives posted ahead -----------------------------------------------------------------

    def _receives(
        self, program: list[tuple[int, zpipe.PipeInstruction]]
    ) -> dict[int, deque[tuple[int, _Receive]]]:
        """Per peer stage, its receive instructions in program order (index, instruction)."""
        found: dict[int, deque[tuple[int, _Receive]]] = {}
        for at, (_, cmd) in enumerate(program):
            if isinstance(cmd, zpipe.RecvActivation | zpipe.RecvGrad):
                peer = self._sender(cmd)
                if peer != self.stage:
                    found.setdefault(peer, deque()).append((at, cmd))
        return found

    def _post_ahead(self, at: int, receives: dict[int, deque[tuple[int, _Receive]]]) -> None:
        """Instruction `at` is done: post each peer's next receive whose size is known now (a
        gradient's once its forward ran, an activation's once its source's shapes are)."""
        link = self.context.link
        for peer, queue in receives.items():
            while queue and queue[0][0] <= at:
                queue.popleft()
            if queue and not link.posted_ahead(peer):
                nbytes = self._frame_bytes(queue[0][1])
                if nbytes is not None:
                    link.post_ahead(peer, nbytes)

    def _sender(self, cmd: _Receive) -> int:
        virtual = self._virtual(cmd)
        return self._peer(virtual - 1 if isinstance(cmd, zpipe.RecvActivation) else virtual + 1)

    def _frame_bytes(self, cmd: _Receive) -> int | None:
        """The size of the frame receive `cmd` takes, or None while it is not known."""
        if isinstance(cmd, zpipe.RecvActivation):
            meta = self.context.link.recv_meta.get(self._virtual(cmd) - 1)
            return frame_size(meta.tensor_slots()) if meta is not None else None
        slot = self.slots.get(self._key(cmd))
        if slot is None or slot.outputs is None:  # its forward has not run yet
            return None
        return frame_size([(t.dtype, tuple(t.shape)) for t in slot.out_floats])

    def _expected(self, remaining: list[zpipe.PipeInstruction]) -> dict[int, int]:
        """Per peer stage, the size of the frame it expects next from this stage: that of the
        first send to it still to come (see [Note: the message format] in _link.py)."""
        link, found = self.context.link, {}
        for cmd in remaining:
            if not isinstance(cmd, zpipe.SendActivation | zpipe.SendGrad):
                continue
            virtual = self._virtual(cmd)
            forward = isinstance(cmd, zpipe.SendActivation)
            peer = self._peer(virtual + 1 if forward else virtual - 1)
            if peer == self.stage or peer in found:
                continue
            if forward:
                meta = link.sent_meta.get(virtual)
                slots = meta.tensor_slots() if meta is not None else []
            else:
                slots = self._grad_slots(cmd, virtual)
            found[peer] = frame_size(slots)
        return found

    def _grad_slots(
        self, cmd: zpipe.BufferOpInstruction, virtual: int
    ) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """The dtypes and shapes of the gradients `cmd` sends: those of the floating-point
        tensors received for its micro-batch (or, not received yet, the last shapes seen)."""
        slot = self.slots.get(self._key(cmd))
        if slot is not None and slot.in_floats:
            return [(t.dtype, tuple(t.shape)) for t in slot.in_floats]
        meta = self.context.link.recv_meta.get(virtual - 1)
        if meta is None:
            return []
        return [(d, shape) for d, shape in meta.tensor_slots() if d.is_floating_point]

    def _handler(self, kind: type[zpipe.PipeInstruction]) -> _Handler | None:
        """The handler of an instruction class, or of its nearest base with one (so a
        subclass of an instruction runs as its base unless it is registered itself)."""
        for klass in kind.__mro__:
            found = self.handlers.get(klass)
            if found is not None:
                return found
        return None

    # -- where an instruction's data lives -----------------------------------------------------

    def _key(self, cmd: zpipe.BufferOpInstruction) -> tuple[int, int]:
        mb = cmd.micro_batch_id
        return (mb if mb is not None else -1 - cmd.buffer_id, cmd.chunk_id)

    def _slot(self, cmd: zpipe.BufferOpInstruction) -> _Slot:
        return self.slots.setdefault(self._key(cmd), _Slot())

    def _virtual(self, cmd: zpipe.BufferOpInstruction) -> int:
        return int(self.schedule.virtual_stage(cmd.chunk_id))

    def _peer(self, virtual: int) -> int:
        return int(self.schedule.owner(virtual)[0])

    # -- data and forward ----------------------------------------------------------------------

    def load(self, cmd: zpipe.LoadMicroBatch) -> None:
        mb = cmd.micro_batch_id
        if mb is None:  # a schedule without micro-batch ids loads them in order
            mb = sum(self.loaded.values()) // max(self.loads, 1)
        if mb not in self.batches:
            if mb in self.loaded:
                raise RuntimeError(f"micro-batch {mb} is loaded more than {self.loads} time(s)")
            if self.data_iter is None:
                raise ValueError("this stage loads micro-batches: pass data_iter")
            try:
                self.batches[mb] = next(self.data_iter)
            except StopIteration:
                raise ValueError(f"data_iter ran out before micro-batch {mb}") from None
        batch = self.batches[mb]
        self.loaded[mb] = self.loaded.get(mb, 0) + 1
        if self.loaded[mb] >= self.loads:
            del self.batches[mb]  # every load of it done: let it go
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise TypeError(
                f"data_iter must yield (inputs, labels) pairs, got {type(batch).__name__}"
            )
        slot, virtual, ctx = self._slot(cmd), self._virtual(cmd), self.context
        device = ctx.device
        if virtual == 0:
            slot.inputs = pytree.tree_map(lambda t: _to(t, device), batch[0])
            if ctx.half_inputs:
                slot.inputs = half_floats(slot.inputs)
            if self.train and ctx.inputs_need_grad:
                slot.inputs = pytree.tree_map(_needing_grad, slot.inputs)
        if virtual == self.last:
            slot.labels = pytree.tree_map(lambda t: _to(t, device), batch[1])

    def forward(self, cmd: zpipe.ForwardPass) -> None:
        slot, ctx = self._slot(cmd), self.context
        with forward_autocast(ctx.autocast, ctx.device):  # torch_autocast's, if on
            outputs = ctx.module(slot.inputs, chunk=cmd.chunk_id)
        if self._virtual(cmd) != self.last:
            slot.outputs, slot.out_floats = outputs, _floats(outputs)
            return
        mb, labels = cmd.micro_batch_id, slot.labels
        if not self.train:
            self.outputs[mb] = outputs
            self.slots.pop(self._key(cmd))
            if not ctx.computes_loss:
                return
        loss_fn = ctx.module.loss_fn
        with forward_autocast(ctx.autocast, ctx.device):
            loss = loss_fn(outputs, labels) if loss_fn is not None else outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                f"the loss must be a tensor of one element, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        self.losses[mb] = loss.detach()
        slot.outputs = loss

    # -- activations ---------------------------------------------------------------------------

    def send_activation(self, cmd: zpipe.SendActivation) -> None:
        slot, virtual = self._slot(cmd), self._virtual(cmd)
        self.context.link.send_activation(
            slot.outputs,
            to=self._peer(virtual + 1),
            micro_batch=cmd.micro_batch_id,
            source=virtual,
        )
        if not self.train:
            self.slots.pop(self._key(cmd))

    def recv_activation(self, cmd: zpipe.RecvActivation) -> None:
        virtual = self._virtual(cmd)
        tensors, meta = self.context.link.recv_activation(  # detached: this stage's graph
            frm=self._peer(virtual - 1),  # starts here
            micro_batch=cmd.micro_batch_id,
            source=virtual - 1,
            where=describe(cmd),
        )
        slot = self._slot(cmd)
        if self.train:
            slot.in_floats = [t.requires_grad_() for t in tensors if t.is_floating_point()]
        slot.inputs = unflatten(tensors, meta)

    # -- backward ------------------------------------------------------------------------------

    def _targets(
        self, cmd: zpipe.BufferOpInstruction, slot: _Slot
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What the backward starts from: the scaled loss, or the outputs and their grads."""
        if self._virtual(cmd) == self.last:
            loss = slot.outputs.float() * self.context.loss_factor
            return [loss], [torch.ones_like(loss)]
        if slot.out_grads is None:
            raise RuntimeError("the backward runs before the gradient of its output arrived")
        pairs = [
            (t, g) for t, g in zip(slot.out_floats, slot.out_grads, strict=True) if t.requires_grad
        ]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def backward(self, cmd: zpipe.BackwardPass) -> None:
        slot = self._slot(cmd)
        outputs, grads = self._targets(cmd, slot)
        if outputs:
            torch.autograd.backward(outputs, grads)
        slot.input_grads = [
            t.grad if t.grad is not None else torch.zeros_like(t) for t in slot.in_floats
        ]
        self._backward_done(cmd, slot)

    def backward_input(self, cmd: zpipe.BackwardInputPass) -> None:
        slot = self._slot(cmd)
        outputs, grads = self._targets(cmd, slot)
        params = self.context.chunk_parameters(cmd.chunk_id)
        slot.split = SplitBackward(outputs, grads, list(slot.in_floats), params)
        found = slot.split.input_pass() if outputs else [None] * len(slot.in_floats)
        slot.input_grads = [
            g if g is not None else torch.zeros_like(t)
            for t, g in zip(slot.in_floats, found, strict=True)
        ]
        slot.outputs, slot.out_floats, slot.out_grads = None, [], None  # the split holds them

    def backward_weight(self, cmd: zpipe.BackwardWeightPass) -> None:
        slot = self._slot(cmd)
        if slot.split is None:
            raise RuntimeError("BackwardWeightPass before its BackwardInputPass")
        slot.split.weight_pass()
        slot.split = None
        self._backward_done(cmd, slot)

    def _backward_done(self, cmd: zpipe.BufferOpInstruction, slot: _Slot) -> None:
        # the micro-batch's weight gradients are all in: into the wide buffers, when the
        # engine accumulates in a wider dtype than the parameters' (grad_accum_dtype)
        self.context.layout.fold()
        slot.outputs, slot.out_floats, slot.out_grads = None, [], None
        slot.backward_done = True
        self._release(cmd, slot)

    def _release(self, cmd: zpipe.BufferOpInstruction, slot: _Slot) -> None:
        """Drop the slot once its backward is done and its input gradients are sent (the
        first virtual stage sends none)."""
        if slot.backward_done and (slot.grads_sent or self._virtual(cmd) == 0):
            self.slots.pop(self._key(cmd), None)

    def send_grad(self, cmd: zpipe.SendGrad) -> None:
        slot, virtual = self._slot(cmd), self._virtual(cmd)
        if slot.input_grads is None:
            raise RuntimeError("SendGrad before the backward that makes the gradients")
        self.context.link.send_grads(
            slot.input_grads,
            to=self._peer(virtual - 1),
            micro_batch=cmd.micro_batch_id,
            source=virtual,
        )
        slot.input_grads, slot.in_floats, slot.inputs = None, [], None
        slot.grads_sent = True
        self._release(cmd, slot)

    def recv_grad(self, cmd: zpipe.RecvGrad) -> None:
        slot, virtual = self._slot(cmd), self._virtual(cmd)
        shapes = [(t.dtype, tuple(t.shape)) for t in slot.out_floats]
        slot.out_grads = self.context.link.recv_grads(
            shapes,
            frm=self._peer(virtual + 1),
            micro_batch=cmd.micro_batch_id,
            source=virtual + 1,
            where=describe(cmd),
        )


def _to(value: object, device: torch.device) -> object:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _needing_grad(value: object) -> object:
    """A floating-point tensor as a leaf that requires grad (detached first: the caller's
    tensor stays as it was), anything else as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_()
    return value
