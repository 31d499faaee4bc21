"""``offload_param: {device: nvme}``: ZeRO-3 shards in files while their module is not running.

zpartition hands a unit's shard here when it releases the unit and asks for it back before the
next all-gather (its `ShardStore` protocol). Each shard is one zoffload handle, so its file is
written and read as the optimizer state's are: large aligned requests, several in flight,
O_DIRECT where the filesystem allows it (the shards do not sit in the page cache, which would
keep in memory what offloading was meant to free), checked on the way back. A reload keeps
the file, and a shard is written again only when its bytes changed since (the optimizer step
changes them, a forward does not), so a training step reads every shard once or twice and
writes each once. The files live in a folder of their own under ``nvme_path``, removed when
the engine is destroyed; they are scratch space for this process, not a checkpoint.

[Note: reading shards ahead]
Read from disk (not from the page cache), a shard fetched only when its all-gather starts
would stall the forward for the whole read. So the store learns the order shards are fetched
in, as zpartition's coordinator learns the order of modules: after shards ``a, b`` came ``c``
last time (two shards of context tell a forward's ``b`` from a backward's; ``b`` alone where
the pair is new), and on each fetch it starts reading the shards that followed last time, on
zoffload's threads, up to ``read_ahead`` elements (the smaller of the config's
`stage3_prefetch_bucket_size` and `sub_group_size`).
The forward then finds them in memory or on their way. A wrong guess costs memory until the
shard's next release, never correctness: every fetch waits for its own shards.

[Note: writing shards behind]
A shard is written before `evict` returns, except while ``write_behind`` is set: a tiled
optimizer step sets it, and each tile's stepped shards go to their files on zoffload's
threads while the next tile is read and stepped (written in turn, the step waited on every
shard's write: 0.9-1.4 s of a 2.2 s step at 39 M parameters, world size 1). The writes in
flight are at most ``read_ahead`` elements (the oldest is waited for beyond that), so the
memory they hold is a tile's shards, freed as each lands. The last tiles' writes run on into
the next forward, which needs those shards last; a fetch of a shard still being written waits
for its write, then reads it back. Outside the step (a forward's release) a shard is written
at once: in the background, the first shards of the next forward would wait for their write
and then read it back (measured: slower).

[Note: shards the step overwrites]
A tiled step writes each stepped master into its shard whole, so a shard whose every
parameter the tile steps need not be read from its file first: `reclaim` gives its memory
back zeroed (the bytes between parameters are zeros, as the unit made them) and drops the
file, and the step's write-back fills it, just before it is written out again. Reading it
would have been a tile's shards per tile (at full size 4.7 GB a step, 2 bytes a parameter).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Sequence

import torch

import zoffload

log = logging.getLogger("zengine")

__all__ = ["NvmeShardStore"]


class NvmeShardStore:
    """Shards kept in one file each under a private folder of `nvme_path`."""

    def __init__(
        self,
        nvme_path: str | os.PathLike[str],
        rank: int,
        offloader: zoffload.Offloader | None = None,
        read_ahead: int = 0,
    ) -> None:
        # marked as this process's ([Note: swap folders] in zoffload): a killed job's are
        # removed by the next one that uses the path
        self.folder = zoffload.claim_folder(nvme_path, f"zengine-params-rank{rank}")
        self.offloader = offloader or zoffload.default_offloader()  # the config's `aio`, if any
        # id(shard) -> its handle and the shard's version its file holds (the handle keeps the
        # shard alive, so the id is not reused)
        self._held: dict[int, tuple[zoffload.OffloadHandle, int]] = {}
        self.read_ahead = read_ahead  # elements of shards to read before they are asked for
        # While True, evicted shards stay in memory (the engine sets it for the backward just
        # before an optimizer step, which needs them all); the protocol allows it.
        self.holding = False
        self._failure: zoffload.OffloadError | None = None  # a write that failed, not agreed
        self._context: tuple[int, int] = (0, 0)  # the last two shards fetched (ids)
        self._after_two: dict[tuple[int, int], int] = {}  # context -> the shard fetched next
        self._after_one: dict[int, int] = {}  # the last shard -> the shard fetched next
        self._ahead: list[int] = []  # shards read ahead and not asked for since (ids)
        # [Note: writing shards behind]: set during a tiled step; the writes in flight (ids)
        self.write_behind = False
        self._behind: list[int] = []
        # the files go when the store does, or at exit, whichever comes first
        self._remove = weakref.finalize(self, zoffload.release_folder, self.folder)

    def evict(self, shard: torch.Tensor) -> None:
        if shard.untyped_storage().nbytes() == 0 or self.holding:
            return  # away already, or kept for the step
        if shard.device.type != "cpu":
            raise ValueError("offload_param to NVMe keeps shards on the host; this one is not")
        # Written before it returns: in the background, the first shards of the next forward
        # would wait for their write and then read it back (measured: slower).
        held = self._held.get(id(shard))
        if held is not None and held[0].state == "offloading":
            return  # written behind, on its way already
        behind = self.write_behind
        try:
            if held is None:
                # scratch: read back by this process only, no fsync ([Note: scratch files])
                handle = self.offloader.offload(
                    {"shard": shard},
                    "nvme",
                    nvme_path=self.folder,
                    durable=False,
                    non_blocking=behind,
                )
            else:
                handle, written = held
                handle.offload(rewrite=shard._version != written, non_blocking=behind)
        except zoffload.OffloadError as error:
            self._note_failure(error)
            return
        self._held[id(shard)] = (handle, shard._version)
        if behind and handle.state == "offloading":
            self._behind.append(id(shard))
            self._bound_behind()

    def _note_failure(self, error: zoffload.OffloadError) -> None:
        """A write failed: the shard stays in memory, bit-exact (a failed write frees nothing;
        the protocol allows keeping it); the ranks raise it together at the next step."""
        if self._failure is None:
            log.warning("zengine: offload_param to NVMe: %s; kept in memory", error)
            self._failure = error

    def _settle(self, key: int) -> None:
        """Wait for shard `key`'s write if one is in flight, noting a failure."""
        held = self._held.get(key)
        if held is not None and held[0].state == "offloading":
            try:
                held[0].wait()
            except zoffload.OffloadError as error:
                self._note_failure(error)

    def _bound_behind(self) -> None:
        """[Note: writing shards behind] The oldest writes waited for while those in flight
        are more than ``read_ahead`` elements."""
        while self._behind:
            pending = 0
            for key in self._behind:
                held = self._held.get(key)
                if held is not None and held[0].state == "offloading" and not held[0].done():
                    pending += held[0].nbytes // held[0].tensors["shard"].element_size()
            if pending <= self.read_ahead:
                return
            self._settle(self._behind.pop(0))

    def settle_writes(self) -> None:
        """Wait for every write in flight ([Note: writing shards behind])."""
        behind, self._behind = self._behind, []
        for key in behind:
            self._settle(key)

    def discard(self, shard: torch.Tensor) -> None:
        """Forget `shard` (zpartition moved its bytes into another unit's shard, `Init`'s
        units to `partition`'s): its file goes, and the store no longer keeps it alive."""
        held = self._held.pop(id(shard), None)
        # the order learned names shards by id, which a new shard may take: start over
        self._after_two.clear()
        self._after_one.clear()
        self._context = (0, 0)
        self._ahead.clear()
        if held is None:
            return
        handle = held[0]
        with contextlib.suppress(zoffload.OffloadError):  # the bytes are in memory already
            handle.wait()
            if handle.offloaded:
                handle.reload()
            handle.discard_copy()

    def take_failure(self) -> zoffload.OffloadError | None:
        """The write failure noted since the last call (writes in flight waited for first),
        and forget it ([Note: NVMe faults agreed])."""
        self.settle_writes()
        failure, self._failure = self._failure, None
        return failure

    def fetch(self, shards: Sequence[torch.Tensor]) -> None:
        coming = [h for h in map(self._reload, shards) if h is not None]  # read side by side
        for shard in shards:
            self._after_two[self._context] = self._after_one[self._context[1]] = id(shard)
            self._context = (self._context[1], id(shard))
        asked = {id(s) for s in shards}
        self._ahead = [key for key in self._ahead if key not in asked]
        self._read_ahead()
        for handle in coming:
            handle.wait()

    def _reload(self, shard: torch.Tensor | int) -> zoffload.OffloadHandle | None:
        """Start reading the shard back if it is away; its handle if it is on its way."""
        key = shard if isinstance(shard, int) else id(shard)
        self._settle(key)  # a write behind first (a failed one left the shard in memory)
        held = self._held.get(key)
        if held is None:
            return None
        handle = held[0]
        if handle.offloaded:
            handle.reload(non_blocking=True, keep=True)
        return None if handle.state == "resident" else handle

    def _read_ahead(self) -> None:
        """[Note: reading shards ahead] The shards read ahead and still not asked for are at
        most ``read_ahead`` elements: those the new guess leaves out go back (unchanged, they
        are not written), so a wrong guess (the first backward follows the forward's order)
        never holds more than that."""
        context, budget, seen, wanted = self._context, self.read_ahead, set(), []
        while budget > 0 and context not in seen:
            seen.add(context)
            key = self._after_two.get(context, self._after_one.get(context[1]))
            held = None if key is None else self._held.get(key)
            if key is None or held is None:
                break
            wanted.append(key)
            budget -= held[0].nbytes // held[0].tensors["shard"].element_size()
            context = (context[1], key)
        for key in self._ahead:
            if key not in wanted:
                self._put_back(key)
        self._ahead = [key for key in wanted if self._reload(key) is not None or key in self._ahead]

    def reclaim(self, shards: Sequence[torch.Tensor]) -> None:
        """`shards` in memory, zeroed, for a caller about to overwrite their parameters'
        bytes ([Note: shards the step overwrites]); a shard in memory already keeps its
        bytes (it is overwritten all the same)."""
        asked = set()
        for shard in shards:
            key = id(shard)
            asked.add(key)
            self._settle(key)
            held = self._held.get(key)
            if held is None:
                continue
            handle = held[0]
            if handle.state == "reloading":  # read ahead: its read completes first
                with contextlib.suppress(zoffload.OffloadError):  # a bad file: not read now
                    handle.wait()
            if handle.offloaded:
                handle.reclaim()
                shard.zero_()
        self._ahead = [key for key in self._ahead if key not in asked]

    def _put_back(self, key: int) -> None:
        """A shard read ahead and not asked for: away again (its file holds its bytes)."""
        held = self._held.get(key)
        if held is None:
            return
        handle, written = held
        try:
            handle.wait()
            if handle.state == "resident":
                # unchanged unless something wrote it without asking for it: then written
                handle.offload(rewrite=handle.tensors["shard"]._version != written)
        except zoffload.OffloadError as error:  # kept in memory; agreed at the next step
            self._note_failure(error)

    def close(self) -> None:
        """Remove the files (the engine is done with the shards)."""
        for handle, _ in self._held.values():
            with contextlib.suppress(zoffload.OffloadError):  # the files go anyway
                handle.wait()  # no read ahead still uses the folder
        self._remove()
        self._held.clear()
