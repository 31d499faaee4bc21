"""A checkpoint from someone else runs nothing, damage is named by every reader, a killed save's
folder goes, and a crashed rank is named as crashed (issue #40)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zcomm
import zengine
from zcomm.testing import DistributedTest
from zengine import _cli as cli
from zengine._checkpoint import (
    ClientStateError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from zengine._checkpoint._files import PARTIAL_MARKER
from zengine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from ._helpers import (
    TinyGPT,
    checkpoint_engine,
    global_batches,
    pipe_config,
    pipe_initialize,
    pipe_train,
    pipeline,
    train_global,
)

TAG = "t"
ASKED = f"{os.mkdir.__module__}.mkdir"  # posix.mkdir on Linux


class Payload:
    """What a malicious checkpoint would carry: unpickling it would create a directory."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _rewrite_manifest(directory: Path, names: list[str]) -> None:
    """The manifest's sizes and CRCs of `names` made to match: a forger's checkpoint."""
    path = directory / "zengine.json"
    manifest = json.loads(path.read_text())
    for name in names:
        data = (directory / name).read_bytes()
        manifest["files"][name].update(crc32=zlib.crc32(data), bytes=len(data))
    path.write_text(json.dumps(manifest))


def plant(directory: Path, key: str, value: Any) -> None:
    """Entry `key` of the DCP checkpoint `directory` replaced by ``torch.save(value)``, the
    entries after it moved, and ``.metadata`` and the manifest rewritten to match."""
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    shard = directory / info.relative_path
    data = shard.read_bytes()
    buffer = io.BytesIO()
    torch.save(value, buffer)
    new = buffer.getvalue()
    shard.write_bytes(data[: info.offset] + new + data[info.offset + info.length :])
    for i, stored in metadata.storage_data.items():
        if stored.relative_path == info.relative_path and stored.offset > info.offset:
            moved = stored.offset + len(new) - info.length
            metadata.storage_data[i] = dataclasses.replace(stored, offset=moved)
    metadata.storage_data[index] = dataclasses.replace(info, length=len(new))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(directory, [info.relative_path, ".metadata"])


def forward_only_engine() -> zengine.Engine:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 16}
    engine, *_ = zengine.initialize(
        model=TinyGPT(), config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    )
    return engine


def consolidate_cli(checkpoint: Path, out: Path) -> tuple[int, str]:
    """``zengine consolidate`` in this process: its exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(["consolidate", str(checkpoint), str(out)])
    return status, err.getvalue()


@contextlib.contextmanager
def logged() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("zengine")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


class TestNothingRuns(DistributedTest):
    world_size = 2

    def test_a_planted_object_is_refused_by_every_reader(self, tmp_path: Path) -> None:
        """Each kind of file a checkpoint holds, with a payload planted (a forger's manifest
        matching it, or not), on every reader: none runs it, each names the file and type or
        the damage; the offline readers check the CRCs as load_checkpoint does."""
        rank = zcomm.get_rank()
        marker = tmp_path / "ran"
        good = tmp_path / "good"
        engine = checkpoint_engine(3)
        train_global(engine, global_batches(1, 4))
        engine.save_checkpoint(good, tag=TAG, client_state={"epoch": 1})
        cases = {  # what is planted where (every rank reads its own rank's entries)
            "client_state": ["rank0/client_state", "rank1/client_state"],
            "rng": ["rank0/rng", "rank1/rng"],
            "engine": ["engine"],
            "master": ["master/embed.weight"],
        }
        if rank == 0:
            for case, keys in cases.items():
                shutil.copytree(good, tmp_path / case)
                for key in keys:
                    plant(tmp_path / case / TAG, key, Payload(marker))
            for case in ("metadata", "metadata_mismatch"):
                shutil.copytree(good, tmp_path / case)
                (tmp_path / case / TAG / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
            _rewrite_manifest(tmp_path / "metadata" / TAG, [".metadata"])
            shutil.copytree(good, tmp_path / "flipped")  # a byte of a stored tensor damaged
            shard = tmp_path / "flipped" / TAG / "__0_0.distcp"
            data = bytearray(shard.read_bytes())
            data[-len(data) // 3] ^= 0x01
            shard.write_bytes(bytes(data))
        zcomm.barrier()
        refused = rf"distcp asks for {ASKED}"
        # a refused load raises before anything is applied: one engine of each kind serves
        trained, forward_only = checkpoint_engine(3), forward_only_engine()
        for case in ("client_state", "rng", "engine", "metadata", "master"):
            expected = rf"\.metadata asks for {ASKED}" if case == "metadata" else refused
            for load in (
                lambda path: trained.load_checkpoint(path),
                lambda path: trained.load_checkpoint(path, load_module_only=True),
                lambda path: forward_only.load_checkpoint(path),
            ):
                with pytest.raises(UnsafeCheckpointError, match=expected):
                    load(tmp_path / case)
        # the offline readers read the masters and .metadata only (never the objects)
        for case in ("master", "metadata"):
            name = ".metadata" if case == "metadata" else "distcp"
            with pytest.raises(UnsafeCheckpointError, match=rf"{name} asks for {ASKED}"):
                get_fp32_state_dict_from_zero_checkpoint(tmp_path / case)
            status, err = consolidate_cli(tmp_path / case, tmp_path / f"out{rank}.pt")
            assert status == 1
            assert f"{name} asks for {ASKED}" in err, err
        # a .metadata the manifest does not match: refused by its CRC, by every reader
        mismatch = tmp_path / "metadata_mismatch"
        damaged = r"\.metadata has \d+ bytes, the manifest says"
        with pytest.raises(CorruptCheckpointError, match=damaged):
            trained.load_checkpoint(mismatch)
        with pytest.raises(CorruptCheckpointError, match=damaged):
            get_fp32_state_dict_from_zero_checkpoint(mismatch)
        status, err = consolidate_cli(mismatch, tmp_path / f"out{rank}.pt")
        assert status == 1
        assert re.search(damaged, err), err
        flipped = r"__0_0\.distcp is corrupt: CRC32"
        with pytest.raises(CorruptCheckpointError, match=flipped):
            get_fp32_state_dict_from_zero_checkpoint(tmp_path / "flipped")
        status, err = consolidate_cli(tmp_path / "flipped", tmp_path / f"out{rank}.pt")
        assert status == 1
        assert re.search(flipped, err), err
        if rank == 0:  # the zero_to_fp32.py save_checkpoint wrote into the folder (it runs
            # the CLI's code: one run, seconds of Python starting)
            run = subprocess.run(
                [sys.executable, "zero_to_fp32.py", ".", str(tmp_path / "script")],
                cwd=tmp_path / "metadata",
                capture_output=True,
                text=True,
                check=False,
            )
            assert run.returncode == 1, run.stderr
            assert re.search(rf"\.metadata asks for {ASKED}", run.stderr), run.stderr
        assert not marker.exists()
        zcomm.barrier()  # every rank's readers done before the files go

    def test_client_state_is_checked_when_saved(self, tmp_path: Path) -> None:
        engine = checkpoint_engine(3)
        with pytest.raises(
            ClientStateError, match=r"rank 0: client_state\['sampler'\]\['gen'\] is a torch"
        ):
            engine.save_checkpoint(tmp_path, client_state={"sampler": {"gen": torch.Generator()}})
        client = {"ok": [1, 2.0, "x", None, b"y", torch.ones(2)]}
        if zcomm.get_rank() == 1:
            client["steps"] = [1, Payload(tmp_path / "ran")]
        with pytest.raises(
            ClientStateError, match=r"rank 1: client_state\['steps'\]\[1\] is a .*Payload"
        ):
            engine.save_checkpoint(tmp_path, client_state=client)
        assert not (tmp_path / "latest").exists()
        assert not (tmp_path / "ran").exists()


class TestPipelineStagesRunNothing(DistributedTest):
    world_size = 2

    def test_a_planted_object_in_a_stage_is_refused(self, tmp_path: Path) -> None:
        cfg = pipe_config(zero_optimization={"stage": 0})
        engine = pipe_initialize(pipeline(2), cfg)
        pipe_train(engine, global_batches(1, 8))
        folder = tmp_path / "ckpt"
        engine.save_checkpoint(folder, tag=TAG, client_state={"step": 1})
        marker = tmp_path / "ran"
        if zcomm.get_rank() == 0:  # stage 0's file only: stage 1 names it too
            plant(folder / "stage0" / TAG, "rank0/client_state", Payload(marker))
        zcomm.barrier()
        expected = rf"stage0/{TAG}/__0_0\.distcp asks for {ASKED}"
        with pytest.raises(UnsafeCheckpointError, match=expected):
            pipe_initialize(pipeline(2), cfg).load_checkpoint(folder)
        assert not marker.exists()


class TestKilledSaveFolders(DistributedTest):
    world_size = 2

    def test_ours_are_removed_at_the_next_save_others_stay(self, tmp_path: Path) -> None:
        killed, foreign = tmp_path / ".killed.partial", tmp_path / ".foreign.partial"
        if zcomm.get_rank() == 0:
            tmp_path.mkdir(exist_ok=True)
            # a save's folder whose process is gone: made by our code in a process that exited
            code = "import sys; from pathlib import Path; from zengine._checkpoint._files "
            code += "import start_partial; start_partial(Path(sys.argv[1]))"
            subprocess.run([sys.executable, "-c", code, str(killed)], check=True)
            (killed / "__0_0.distcp").write_bytes(b"half")
            foreign.mkdir()
            (foreign / "keep").write_text("not zstack's")
        zcomm.barrier()
        engine = checkpoint_engine(3)
        with logged() as lines:
            engine.save_checkpoint(tmp_path, tag=TAG)
        assert not killed.exists()
        assert (foreign / "keep").exists()
        assert not (tmp_path / TAG / PARTIAL_MARKER).exists()  # a complete save keeps none
        said = [line for line in lines if str(killed) in line]
        if zcomm.get_rank() == 0:
            assert said, lines
            assert "left by a save that did not finish" in said[0]
        else:
            assert not said


class _RankCrashes(DistributedTest):
    failure_grace = 5.0

    def test_rank_1_exits_instead_of_saving(self, world_size: int, tmp_path: Path) -> None:
        engine = checkpoint_engine(3)
        if zcomm.get_rank() == 1:
            os._exit(3)
        engine.save_checkpoint(tmp_path)


def test_a_rank_that_crashed_is_named_as_crashed(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        _RankCrashes().test_rank_1_exits_instead_of_saving(world_size=2, tmp_path=tmp_path)
    message = str(info.value)
    assert "rank 1 exited with code 3" in message
    assert "rank 1 exited or crashed instead of calling save_checkpoint" in message
    assert "CommTimeoutError" not in message
