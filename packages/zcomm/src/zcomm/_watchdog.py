"""The watchdog: a rank that stops answering, or ranks out of step, end in a named error.

[Note: the watchdog]
A gloo collective whose peer froze (SIGSTOP, a debugger, a swapped-out host) or never comes
(it runs another engine call) blocks for the process group's timeout, 30 minutes by default,
without a word; a blocked collective cannot be interrupted from another thread. But a
collective issued asynchronously can be waited on with a timeout, and stays valid after one:
so zcomm waits on host (gloo) collectives in *slices* (`SLICE`, one second). The hot path is
unchanged: the collective is issued with ``async_op=True`` and waited once with the slice as
timeout, the same two calls torch makes for a synchronous one (its own ``work.wait()``).

Only a wait longer than a slice takes the slow path, `wait_slowly`. Meanwhile a daemon thread
per process (started by ``init_distributed``, stopped by ``destroy``) writes a heartbeat to the
process group's store every `interval` seconds: a counter, this rank's engine call and step
(`set_activity`, set by the engine on entry to each call) and the collective the main thread
waits in, if any, and for how long. While the main thread waits slowly, the thread also reads
the other ranks' heartbeats. The main thread, between slices, then decides:

* a rank whose counter has not moved for `bound` seconds (of this rank's clock: no clock
  skew between hosts matters) stopped answering: `RankUnresponsiveError` names it, its last
  call, step and collective; a store that itself stopped answering names its host;
* every other rank alive and waiting in a collective too, but not all the same call, step and
  collective, for `bound` seconds: `RanksOutOfStepError` names what each rank waits in;
* otherwise (a rank alive and computing, or every rank in the same slow collective) the wait
  is legitimate: it goes on, with a progress line every `bound` seconds, so a long wait is
  never silent.

The bound is 30 s by default (a frozen rank is named within about 35 s); ``ZCOMM_WATCHDOG``
(seconds), ``init_distributed(watchdog=...)`` or `set_watchdog` change it, and 0 turns the
checks off (the slices and progress lines remain). Device (NCCL) collectives are left as they
are: they wait on the device, not here. Point-to-point operations are not sliced either: on
gloo a timed wait on a receive fails it and closes the connection ("Application timeout caused
pair closure"), and its work never reports completion unless waited on (measured, torch 2.13);
a pipeline's waits are bounded by its own ``pipeline.p2p_timeout`` instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from zcomm._errors import CommError, comm_error, describe_group

__all__ = [
    "ACTIVITY",
    "CALLS",
    "SLICE",
    "Activity",
    "RankUnresponsiveError",
    "RanksOutOfStepError",
    "set_activity",
    "set_watchdog",
    "start",
    "stop",
    "wait_slowly",
    "watchdog_seconds",
]

log = logging.getLogger("zcomm")

DEFAULT_BOUND = 30.0  # seconds a rank may stay silent before it is named
SLICE = timedelta(seconds=1)  # how long one wait on a host collective lasts before a check
_KEY = "zcomm/watchdog/"
_ENV = "ZCOMM_WATCHDOG"

# The engine calls a header or heartbeat can name (their index is the code in a header).
CALLS = (
    "no engine call",
    "forward",
    "backward",
    "step",
    "save_checkpoint",
    "load_checkpoint",
    "offload_states",
    "reload_states",
    "train_batch",
    "eval_batch",
)
_CODES = {name: code for code, name in enumerate(CALLS)}


class RankUnresponsiveError(CommError):
    """A rank stopped answering (frozen, stopped, or its host unreachable) while this rank
    waited for it in a collective. ``silent_rank`` is the rank named."""

    silent_rank: int


class RanksOutOfStepError(CommError):
    """Every rank of a group waits in a collective, but not in the same one (different engine
    calls, steps or collectives): none of them can complete."""


class Activity:
    """What this rank is doing now: the engine call and its step (`set_activity`)."""

    __slots__ = ("call", "code", "step")

    def __init__(self) -> None:
        self.call = CALLS[0]
        self.code = 0
        self.step = 0

    def describe(self) -> str:
        return f"{self.call}, step {self.step}"


ACTIVITY = Activity()


def set_activity(call: str, step: int) -> None:
    """Record that this rank now runs engine call `call` (one of `CALLS`) at step `step`; the
    ranks' headers and heartbeats carry it, and errors name it."""
    ACTIVITY.call = call
    ACTIVITY.code = _CODES.get(call, 0)
    ACTIVITY.step = step


def _env_bound() -> float:
    value = os.environ.get(_ENV)
    if value is None:
        return DEFAULT_BOUND
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(
            f"environment variable {_ENV}={value!r} is not a number of seconds"
        ) from None
    return _checked(seconds, f"environment variable {_ENV}")


def _checked(seconds: object, where: str) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError(
            f"{where}: expected seconds >= 0 (0 turns the watchdog off), got {seconds!r}"
        )
    return float(seconds)


@dataclass
class _Seen:
    """A peer's last heartbeat as this rank read it, and when (this rank's clock) it changed."""

    beat: str
    changed: float


@dataclass
class _Waiting:
    op: str
    what: str  # the collective and its group, in words (worked out by the main thread)
    since: float  # time.monotonic() when the wait began


class _Watchdog:
    """The heartbeat thread of this process and what it read of the others'."""

    def __init__(self, store: Store, rank: int, world_size: int, bound: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.bound = bound
        self.store = store
        self.waiting: _Waiting | None = None  # set by the main thread in `wait_slowly`
        self.seen: dict[int, _Seen] = {}
        # [Note: shared verdicts] a rank that finds the ranks out of step says so in the
        # store (a counter, then the message under its number), so that a rank whose wait a
        # raising rank could complete by joining it later raises too: every rank gets the error
        self.verdicts_seen: int | None = None  # the counter when this wait began
        self.verdict: str | None = None  # a verdict published since
        self.last_read = time.monotonic()  # the last time the store answered
        self.counter = 0
        self.progress_lines = 0  # progress lines logged in the current wait
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="zcomm-watchdog", daemon=True)

    @property
    def interval(self) -> float:
        return min(2.0, max(0.2, (self.bound or DEFAULT_BOUND) / 10))

    def _beat(self) -> str:
        waiting = self.waiting
        if waiting is None:
            where = "-"
        else:
            where = f"{waiting.what} for {time.monotonic() - waiting.since:.0f} s"
        return f"{self.counter}|{ACTIVITY.call}|{ACTIVITY.step}|{where}"

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.counter += 1
            try:
                self.store.set(f"{_KEY}{self.rank}", self._beat())
                if self.waiting is not None:
                    self._read()
                self.last_read = time.monotonic()
            except Exception:  # a store that fails or times out: last_read says it
                pass
            self.stopped.wait(self.interval)

    def _read(self) -> None:
        now = time.monotonic()
        count = self.store.add(f"{_KEY}verdicts", 0)
        if self.verdicts_seen is None:
            self.verdicts_seen = count
        elif count > self.verdicts_seen and self.verdict is None:
            self.verdict = self.store.get(f"{_KEY}verdict/{count}").decode()
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            key = f"{_KEY}{peer}"
            if not self.store.check([key]):
                continue  # no watchdog there (yet): nothing to judge it by
            beat = self.store.get(key).decode()
            seen = self.seen.get(peer)
            if seen is None or seen.beat.split("|", 1)[0] != beat.split("|", 1)[0]:
                self.seen[peer] = _Seen(beat, now)
            else:
                seen.beat = beat


_watchdog: _Watchdog | None = None
_bound: float | None = None  # set_watchdog's or init_distributed's; None: the environment's


def watchdog_seconds() -> float:
    """The bound in force: seconds a rank may stay silent before it is named (0: off)."""
    return _env_bound() if _bound is None else _bound


def set_watchdog(seconds: float) -> None:
    """Set the watchdog's bound: a rank silent for `seconds` while another waits for it in a
    collective is named in an error; so are ranks waiting in different collectives for that
    long. 0 turns the checks off. Overrides ``ZCOMM_WATCHDOG``."""
    global _bound
    _bound = _checked(seconds, "set_watchdog(seconds)")
    if _watchdog is not None:
        _watchdog.bound = _bound


def _store() -> Store | None:
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None
    try:
        clone: Store = store.clone()  # type: ignore[attr-defined]  # a connection of its own, so a hung read blocks only the thread
    except (RuntimeError, AttributeError):
        return store
    clone.set_timeout(timedelta(seconds=max(5.0, min(30.0, watchdog_seconds() or 30.0))))
    return clone


def start() -> None:
    """Start this process's heartbeat thread (a world of more than one rank; idempotent)."""
    global _watchdog
    if _watchdog is not None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = _store()
    if store is None:
        return
    _watchdog = _Watchdog(store, dist.get_rank(), dist.get_world_size(), watchdog_seconds())
    _watchdog.thread.start()


def stop() -> None:
    """Stop the heartbeat thread (``destroy`` calls it)."""
    global _watchdog
    watchdog, _watchdog = _watchdog, None
    if watchdog is not None:
        watchdog.stopped.set()
        watchdog.thread.join(timeout=5)


def _peers(group: dist.ProcessGroup | None) -> list[int]:
    me = dist.get_rank()
    if group is None or group is dist.group.WORLD:
        return [r for r in range(dist.get_world_size()) if r != me]
    return [r for r in dist.get_process_group_ranks(group) if r != me]


def _said(beat: str) -> tuple[str, str, str]:
    """(call, step, collective) of a heartbeat ``counter|call|step|where``."""
    _, call, step, where = [*beat.split("|", 3), "", "", ""][:4]
    return call, step, where


def _mine(op: str, group: dist.ProcessGroup | None, waited: float) -> str:
    return (
        f"this rank ({dist.get_rank()}) is in {ACTIVITY.describe()}, waiting {waited:.0f} s in "
        f"{op} on {describe_group(group)}"
    )


_P2P = ("send", "recv")  # a send waits for its receive: a pair that is never out of step


def _silent(watchdog: _Watchdog, op: str, group: dist.ProcessGroup | None, waited: float) -> None:
    """Raise `RankUnresponsiveError` if the store or a rank of `group` went silent."""
    now = time.monotonic()
    bound = watchdog.bound
    if now - watchdog.last_read > bound:
        raise RankUnresponsiveError(
            op,
            describe_group(group),
            dist.get_rank(),
            f"the process group's store has not answered for {now - watchdog.last_read:.0f} s "
            "(the rank hosting it, rank 0 under torchrun's env://, probably stopped "
            f"answering); {_mine(op, group, waited)}",
        )
    for peer in _peers(group):
        seen = watchdog.seen.get(peer)
        if seen is None or now - seen.changed <= bound:
            continue
        call, step, where = _said(seen.beat)
        doing = "computing" if where == "-" else f"waiting in {where}"
        error = RankUnresponsiveError(
            op,
            describe_group(group),
            dist.get_rank(),
            f"rank {peer} has not answered for {now - seen.changed:.0f} s (frozen, stopped or "
            f"unreachable); its last heartbeat: {call}, step {step}, {doing}; "
            f"{_mine(op, group, waited)}",
        )
        error.silent_rank = peer
        raise error


def _others(watchdog: _Watchdog) -> tuple[list[str], bool]:
    """A line per other rank of the world, and whether every one of them waits in a
    collective other than this rank's (call, step and collective)."""
    lines, stuck = [], watchdog.world_size > 1
    waiting = watchdog.waiting
    mine = (ACTIVITY.call, str(ACTIVITY.step), waiting.what if waiting else "")
    for peer in range(watchdog.world_size):
        if peer == watchdog.rank:
            continue
        seen = watchdog.seen.get(peer)
        if seen is None:
            lines.append(f"rank {peer}: no heartbeat read")
            stuck = False
            continue
        call, step, where = _said(seen.beat)
        if where == "-":
            lines.append(f"rank {peer} is in {call}, step {step}, computing")
            stuck = False
            continue
        lines.append(f"rank {peer} is in {call}, step {step}, waiting in {where}")
        theirs = where.rsplit(" for ", 1)[0]  # "<collective> on <group>"
        if (call, step, theirs) == mine or theirs.split(" ", 1)[0] in _P2P:
            stuck = False  # the same collective (slow, not stuck), or a transfer under way
    return lines, stuck


def _publish(watchdog: _Watchdog, text: str) -> None:
    """Tell the other ranks that this one found them out of step ([Note: shared verdicts])."""
    try:
        count = watchdog.store.add(f"{_KEY}verdicts", 1)
        watchdog.store.set(f"{_KEY}verdict/{count}", text)
    except Exception:  # a store that fails: the others find it out themselves
        log.warning("zcomm: could not publish the watchdog's verdict to the store")


def _check(watchdog: _Watchdog, op: str, group: dist.ProcessGroup | None, since: float) -> None:
    """Between two slices of a wait: raise if a rank went silent, or if every rank waits in
    a different collective, for longer than the bound; else log progress now and then."""
    waited = time.monotonic() - since
    if watchdog.bound and waited > watchdog.bound:
        _silent(watchdog, op, group, waited)
    lines, stuck = _others(watchdog)
    if watchdog.verdict is not None:  # [Note: shared verdicts]
        raise RanksOutOfStepError(
            op,
            describe_group(group),
            dist.get_rank(),
            f"{watchdog.verdict}; and {_mine(op, group, waited)}",
        )
    if watchdog.bound and waited > watchdog.bound and stuck and op not in _P2P:
        text = (
            "the ranks are out of step: every rank waits in a collective, but not the same "
            f"one, for over {watchdog.bound:g} s; {_mine(op, group, waited)}; " + "; ".join(lines)
        )
        _publish(watchdog, f"rank {dist.get_rank()} found: {text}")
        raise RanksOutOfStepError(op, describe_group(group), dist.get_rank(), text)
    every = watchdog.bound or DEFAULT_BOUND
    if waited >= every * (watchdog.progress_lines + 1):
        watchdog.progress_lines += 1
        log.warning("zcomm: %s; %s", _mine(op, group, waited), "; ".join(lines))


def wait_slowly(
    work: dist.Work,
    op: str,
    group: dist.ProcessGroup | None,
    timeout: timedelta | None = None,
) -> None:
    """Wait on `work`, which has not completed within one `SLICE`, in slices, checking the
    other ranks between them ([Note: the watchdog]); raise `CommError` if it failed, and
    `CommTimeoutError` once `timeout` (the caller's, if it gave one) has passed."""
    since = time.monotonic() - SLICE.total_seconds()
    deadline = None if timeout is None else since + timeout.total_seconds()
    start()  # a world torch started without zcomm: the heartbeat starts now
    watchdog = _watchdog
    if watchdog is not None:
        watchdog.waiting = _Waiting(op, f"{op} on {describe_group(group)}", since)
        watchdog.progress_lines = 0
        watchdog.seen.clear()
        watchdog.verdicts_seen = watchdog.verdict = None
    try:
        while True:
            try:
                work.wait(SLICE)
                return
            except RuntimeError as error:
                if work.is_completed():
                    try:
                        work.wait()  # done after all, or failed: its own error
                    except RuntimeError as failure:
                        raise comm_error(op, group, failure) from failure
                    return
                if "timed out" not in str(error).lower():
                    raise comm_error(op, group, error) from error
                if deadline is not None and time.monotonic() >= deadline:
                    raise comm_error(op, group, error) from error  # the caller's timeout
            if watchdog is not None:
                _check(watchdog, op, group, since)
    finally:
        if watchdog is not None:
            watchdog.waiting = None
