"""A stage's point-to-point messages: activations down the pipeline, gradients back up.

[Note: the message format]
Every message is one *frame*: a byte tensor holding a header (kind, micro-batch, sending
virtual stage, a size) and then the payload's tensors, each at an aligned offset, so that a
message costs one send and one receive. The receiver must know a frame's size before it posts
the receive, and it does: a gradient mirrors the floating-point tensors of the activation it
belongs to, whose shapes both ends know, and an activation has the shapes of the last *meta*
(the payload's structure, dtypes and shapes, see _payload.py) sent on its channel, which both
ends keep. When the shapes change, the sender first sends a frame of the size the receiver
expects, marked META with nothing in it, then the new meta, then the frame; so the meta
travels only when it changes.

The header lets the receiver check that a message is the one its own schedule expects, so
stages that disagree on the schedule fail with an error naming both instructions instead of
reading the wrong tensors. A stage that fails sends each other stage a frame of the size that
stage expects next from it (its own schedule says which message that is), marked ABORT and
followed by the error's text: the stage waiting on it raises that error and passes it on, so
the whole pipeline stops with the cause named. A message between two chunks of one stage
never leaves the process (a local queue).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

import zcomm
from zengine.pipe._errors import PipelineError
from zengine.pipe._payload import Meta, flatten

__all__ = ["Link", "frame_size"]

ACTIVATION, GRADIENT, META, ABORT = 1, 2, 3, 4
_KINDS = {
    ACTIVATION: "an activation",
    GRADIENT: "a gradient",
    META: "an activation (new shapes)",
    ABORT: "an abort",
}
_HEADER = 32  # bytes: four int64, kind, micro-batch (-1: none), sending virtual stage, a size
_ALIGN = 16  # every tensor of a frame starts at a multiple of this many bytes

Slots = Sequence[tuple[torch.dtype, tuple[int, ...]]]


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return _padded(torch.Size(shape).numel() * dtype.itemsize)


def frame_size(slots: Slots) -> int:
    """The bytes of a frame carrying tensors of these dtypes and shapes."""
    return _HEADER + sum(_nbytes(dtype, shape) for dtype, shape in slots)


def _header_id(micro_batch: int | None) -> int:
    """The micro-batch a frame's header names: a schedule without micro-batch ids cannot send
    to another stage (the TypeError torch raises for a None in the header, saying why)."""
    if micro_batch is None:
        raise TypeError(
            "a message to another stage names its micro-batch: the schedule's send "
            "instructions have no micro_batch_id"
        )
    return micro_batch


class Link:
    """The messages of one stage. `rank_of(stage)` is the global rank of a stage of this
    rank's pipeline; `timeout` (seconds) bounds every wait for a message; `device` is where
    frames live (the GPU for NCCL)."""

    def __init__(
        self,
        stage: int,
        stages: int,
        rank_of: Callable[[int], int],
        timeout: float,
        device: torch.device | None = None,
    ) -> None:
        self.stage = stage
        self.stages = stages
        self.rank_of = rank_of
        self.timeout = timedelta(seconds=timeout)
        self.device = device or torch.device("cpu")
        self.sent_meta: dict[int, Meta] = {}  # by sending virtual stage: what the peer holds
        self.recv_meta: dict[int, Meta] = {}  # by sending virtual stage: what the peer sent
        self._in_flight: deque[tuple[zcomm.Handle, torch.Tensor]] = deque()  # sends, their data
        self._local: dict[tuple[int, int], deque[Any]] = {}  # (kind, virtual stage) -> queue
        self._told_by: int | None = None  # the stage whose abort this stage received
        self._ahead: dict[int, tuple[zcomm.Handle, torch.Tensor]] = {}  # by stage: see post_ahead
        self.metas_sent = 0  # how often a payload's shapes changed (tests read it)
        self.received_ahead = 0  # receives that found their message posted ahead (tests too)

    # -- sending -------------------------------------------------------------------------------

    def send_activation(
        self, payload: Any, *, to: int, micro_batch: int | None, source: int
    ) -> None:
        """Send a forward output from virtual stage `source` to stage `to`. (A payload is
        what the model's layers pass on: any nest of tensors and other values.)"""
        if to == self.stage:
            self._local.setdefault((ACTIVATION, source), deque()).append(payload)
            return
        micro_batch = _header_id(micro_batch)
        tensors, meta = flatten(payload)
        held = self.sent_meta.get(source)
        if held != meta:
            encoded = meta.encode().to(self.device)
            expected = frame_size(held.tensor_slots() if held is not None else [])
            self._post(to, self._frame(META, micro_batch, source, encoded.numel(), [], expected))
            self._post(to, encoded)
            self.sent_meta[source] = meta
            self.metas_sent += 1
        self._post(to, self._frame(ACTIVATION, micro_batch, source, 0, tensors))

    def send_grads(
        self, grads: list[torch.Tensor], *, to: int, micro_batch: int | None, source: int
    ) -> None:
        """Send the input gradients of virtual stage `source` to stage `to`."""
        if to == self.stage:
            self._local.setdefault((GRADIENT, source), deque()).append(grads)
            return
        micro_batch = _header_id(micro_batch)
        self._post(to, self._frame(GRADIENT, micro_batch, source, 0, grads))

    def _frame(
        self,
        kind: int,
        micro_batch: int,
        source: int,
        size: int,
        tensors: Sequence[torch.Tensor],
        length: int | None = None,
    ) -> torch.Tensor:
        """One frame: the header, then each tensor's bytes at an aligned offset (one copy)."""
        header = torch.tensor([kind, micro_batch, source, size], dtype=torch.int64)
        parts = [header.to(self.device).view(torch.uint8)]
        for tensor in tensors:
            flat = tensor.detach().contiguous().view(-1)
            if flat.numel() == 1 and flat.stride(0) != 1:
                # one element counts as contiguous whatever its stride: an expanded gradient
                # (autograd.grad of x + w, say) keeps stride 0, which a byte view refuses
                flat = flat.clone(memory_format=torch.contiguous_format)
            data = flat.view(torch.uint8)
            parts.append(data)
            pad = _padded(data.numel()) - data.numel()
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=self.device))
        if length is not None:
            filled = sum(p.numel() for p in parts)
            parts.append(torch.zeros(length - filled, dtype=torch.uint8, device=self.device))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _post(self, to: int, tensor: torch.Tensor) -> None:
        # let the oldest finished sends go, so their tensors can be freed
        while self._in_flight and self._in_flight[0][0].is_completed():
            self._in_flight.popleft()
        self._in_flight.append((zcomm.isend(tensor, self.rank_of(to)), tensor))

    def drain(self) -> None:
        """Wait for the sends in flight (their tensors may then be reused or freed)."""
        while self._in_flight:
            handle, _ = self._in_flight.popleft()
            self._wait(handle, "the end of the batch", "its last messages were not taken")

    # -- receiving -----------------------------------------------------------------------------

    def recv_activation(
        self, *, frm: int, micro_batch: int | None, source: int, where: str
    ) -> tuple[list[torch.Tensor], Meta]:
        """The forward output virtual stage `source` (on stage `frm`) sends this stage, taken
        apart (detached tensors and the meta): the receiver rebuilds it once, from its own."""
        if frm == self.stage:
            return flatten(self._pop(ACTIVATION, source, where))
        meta = self.recv_meta.get(source)
        frame = self._recv(frm, frame_size(meta.tensor_slots() if meta else []), where)
        size = self._check(frame, frm, (META, ACTIVATION), micro_batch, source, where)
        if self._kind(frame) == META:
            meta = Meta.decode(self._recv(frm, size, where))
            self.recv_meta[source] = meta
            frame = self._recv(frm, frame_size(meta.tensor_slots()), where)
            self._check(frame, frm, (ACTIVATION,), micro_batch, source, where)
        if meta is None:
            raise PipelineError(
                f"stage {self.stage}, {where}: stage {frm} sent an activation without its "
                "shapes; the ranks disagree on the schedule",
                stage=self.stage,
                instruction=where,
            )
        return self._unpack(frame, meta.tensor_slots()), meta

    def recv_grads(
        self, slots: Slots, *, frm: int, micro_batch: int | None, source: int, where: str
    ) -> list[torch.Tensor]:
        """The gradients of this stage's output, sent back by virtual stage `source`."""
        if frm == self.stage:
            grads: list[torch.Tensor] = self._pop(GRADIENT, source, where)
            return grads
        frame = self._recv(frm, frame_size(slots), where)
        self._check(frame, frm, (GRADIENT,), micro_batch, source, where)
        return self._unpack(frame, slots)

    def _pop(self, kind: int, source: int, where: str) -> Any:
        queue = self._local.get((kind, source))
        if not queue:
            raise PipelineError(
                f"stage {self.stage}, {where}: nothing was handed over from virtual stage "
                f"{source} of this stage yet; the schedule receives before it sends",
                stage=self.stage,
                instruction=where,
            )
        return queue.popleft()

    def post_ahead(self, frm: int, nbytes: int) -> None:
        """Post the next receive from stage `frm` now, a frame of `nbytes` (what this stage's
        schedule expects next from it), so that the message moves while this stage computes;
        the receive that asks for it takes it. One at a time per stage, and only where a
        posted receive never holds up a send (gloo: see PipelineEngine.receive_ahead)."""
        if frm == self.stage or frm in self._ahead:
            return
        data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._ahead[frm] = (zcomm.irecv(data, self.rank_of(frm)), data)

    def posted_ahead(self, frm: int) -> bool:
        return frm in self._ahead

    def _recv(self, frm: int, nbytes: int, where: str) -> torch.Tensor:
        ahead = self._ahead.pop(frm, None)
        if ahead is None:
            data = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            handle = zcomm.irecv(data, self.rank_of(frm))
        else:
            handle, data = ahead
            self.received_ahead += 1
            if data.numel() != nbytes:  # a bug of this module, not of the peer: say so
                raise RuntimeError(
                    f"stage {self.stage}, {where}: a receive from stage {frm} was posted ahead "
                    f"for {data.numel()} bytes, the frame expected has {nbytes}"
                )
        self._wait(handle, where, f"nothing came from stage {frm} (rank {self.rank_of(frm)})")
        return data

    @staticmethod
    def _unpack(frame: torch.Tensor, slots: Slots) -> list[torch.Tensor]:
        """The frame's tensors, as views of it (no copy)."""
        tensors, at = [], _HEADER
        for dtype, shape in slots:
            n = torch.Size(shape).numel() * dtype.itemsize
            tensors.append(frame[at : at + n].view(dtype).view(shape))
            at += _padded(n)
        return tensors

    @staticmethod
    def _kind(frame: torch.Tensor) -> int:
        return int(frame[:8].view(torch.int64).item())

    def _wait(self, handle: zcomm.Handle, where: str, what: str) -> None:
        try:
            handle.wait(self.timeout)
        except (zcomm.RankUnresponsiveError, zcomm.RanksOutOfStepError):
            raise  # the watchdog named the rank that stopped answering: said as it is
        except zcomm.CommError as error:
            raise PipelineError(
                f"stage {self.stage}, {where}: {what} within {self.timeout.total_seconds():g} s "
                f"(pipeline.p2p_timeout); the peer failed or waits for something else: {error}",
                stage=self.stage,
                instruction=where,
            ) from error

    def _check(
        self,
        frame: torch.Tensor,
        frm: int,
        kinds: tuple[int, ...],
        micro_batch: int | None,  # None never matches: a frame names its micro-batch
        source: int,
        where: str,
    ) -> int:
        """Raise on an abort or on a message other than the expected; returns the size."""
        kind, got_mb, got_source, size = frame[:_HEADER].view(torch.int64).tolist()
        if kind == ABORT:
            self._told_by = frm
            text = bytes(self._recv(frm, size, where).tolist()).decode()
            raise PipelineError(
                f"stage {self.stage} stopped in {where}: {text}",
                stage=self.stage,
                instruction=where,
            )
        if kind not in kinds or (got_mb, got_source) != (micro_batch, source):
            raise PipelineError(
                f"stage {self.stage}, {where}: expected {_KINDS[kinds[-1]]} of micro-batch "
                f"{micro_batch} from virtual stage {source} (stage {frm}), got "
                f"{_KINDS.get(kind, f'kind {kind}')} of micro-batch {got_mb} from virtual "
                f"stage {got_source}; the ranks disagree on the schedule",
                stage=self.stage,
                instruction=where,
            )
        return int(size)

    # -- failure -------------------------------------------------------------------------------

    def abort(self, text: str, expected: dict[int, int], *, grace: float = 3.0) -> None:
        """Tell the other stages that the pipeline failed: each stage in `expected` (but the
        one that told us) gets a frame of the size it expects next from this one, marked
        ABORT, then the text. All messages in flight get `grace` seconds to leave: a process
        that exits at once would lose them, and a stage still reading earlier ones would
        never see the abort."""
        data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(self.device)
        for stage, length in expected.items():
            if stage in (self.stage, self._told_by):
                continue
            try:
                frame = self._frame(ABORT, -1, -1, data.numel(), [], max(length, _HEADER))
                self._post(stage, frame)
                self._post(stage, data)
            except zcomm.CommError:
                pass  # the error being reported matters more than telling this peer
        deadline = time.monotonic() + grace
        for handle, _ in self._in_flight:
            left = deadline - time.monotonic()
            # a stage that is not listening gives up the wait: another stage will tell it
            with contextlib.suppress(zcomm.CommError):
                handle.wait(timedelta(seconds=max(left, 0.01)))
        self._in_flight.clear()
