"""The ``zero_to_fp32.py`` that ``save_checkpoint`` writes into every save_dir, as DeepSpeed's
users run it: ``python zero_to_fp32.py . OUT`` from the folder, with DeepSpeed's arguments. Real
checkpoints from 2-rank runs (a ZeRO-3 engine with tied and frozen weights; a pipeline engine of
2 stages) and one of DeepSpeed's own; the script run as a subprocess once a test (the process a
user starts), its other runs in this process (the same file and code, without a torch import
of seconds each); its files compared with the model's full parameters and with
``zengine consolidate``'s file."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import runpy
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zcomm
from zcomm.testing import DistributedTest
from zengine._checkpoint import fp32_state_dict, read_safetensors
from zengine._checkpoint._recovery import change_permissions, write_recovery_script
from zengine.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

from ._ds_fixture import FIXTURES
from ._helpers import HIDDEN, global_batches, pipe_config, pipe_initialize, pipe_train, pipeline
from ._helpers import train_global as train
from .test_checkpoint_consolidate import every_name, tied_engine

SCRIPT = "zero_to_fp32.py"


def run(args: list[str | Path], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A command as a user runs it, with this interpreter and its packages."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def run_here(args: list[str | Path], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`run`'s command (a script, or ``-m`` and a module) in this process, as ``python`` runs
    it: its ``__main__``, with its arguments in ``sys.argv``, from `cwd`; its exit status and
    what it wrote to stderr."""
    command = [str(a) for a in args]
    err = io.StringIO()
    argv, here = sys.argv, os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                if command[0] == "-m":
                    sys.argv = [command[1], *command[2:]]
                    runpy.run_module(command[1], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = command
                    runpy.run_path(command[0], run_name="__main__")
                code = 0
            except SystemExit as exit:
                if exit.code is None or isinstance(exit.code, int):
                    code = exit.code or 0
                else:  # sys.exit("message"): python prints it and exits 1
                    print(exit.code, file=sys.stderr)
                    code = 1
    finally:
        sys.argv = argv
        os.chdir(here)
    return subprocess.CompletedProcess(command, code, "", err.getvalue())


def converted(
    args: list[str | Path], out: Path, cwd: Path | None = None, here: bool = True
) -> dict[str, torch.Tensor]:
    """Run the script (in this process, or as a subprocess where `here` is false); every tensor
    of the files it wrote into `out` (its shards checked against their index)."""
    done = (run_here if here else run)(args, cwd)
    assert done.returncode == 0, done.stderr
    files = sorted(os.listdir(out))
    index = [f for f in files if f.endswith(".index.json")]
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        if name.endswith(".safetensors"):
            part = read_safetensors(out / name)
        elif name.endswith(".bin"):
            part = torch.load(out / name, weights_only=True)
        else:
            continue
        if index:
            weight_map = json.loads((out / index[0]).read_text())["weight_map"]
            assert all(weight_map[k] == name for k in part), name
        loaded.update(part)
    return loaded


def assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], value), name


class TestScriptInSaveDir(DistributedTest):
    world_size = 2

    def test_the_folders_script_gives_the_model(self, tmp_path: Path) -> None:
        engine = tied_engine(3)  # the head tied to the embedding, blocks.0.norm frozen
        ckpt = tmp_path / "ckpt"
        train(engine, global_batches(2, 4))
        engine.save_checkpoint(ckpt)
        first = every_name(engine)
        train(engine, global_batches(1, 4, seed=8))
        engine.save_checkpoint(ckpt, tag="later")
        later = every_name(engine)
        if zcomm.get_rank() != 0:
            return
        script = ckpt / SCRIPT
        assert script.stat().st_mode & stat.S_IXUSR  # executable, as DeepSpeed makes it
        assert not (ckpt / "later" / SCRIPT).exists()

        # from the folder, as DeepSpeed's users run it: the tag 'latest' names
        state = converted([SCRIPT, ".", tmp_path / "bin"], tmp_path / "bin", ckpt, here=False)
        assert os.listdir(tmp_path / "bin") == ["pytorch_model.bin"]
        assert_equal(state, later)
        assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()  # one storage
        done = run_here(["-m", "zengine", "consolidate", ckpt, tmp_path / "consolidated.pt"])
        assert done.returncode == 0, done.stderr
        assert_equal(state, torch.load(tmp_path / "consolidated.pt", weights_only=True))

        out = tmp_path / "safe"
        state = converted([script, ckpt, out, "--safe_serialization"], out)
        assert os.listdir(out) == ["model.safetensors"]
        # safetensors cannot share a storage: the tied head is left to the model to tie
        assert_equal(state, {k: v for k, v in later.items() if k != "head.weight"})

        # an earlier tag, in shards of at most one up-projection weight's bytes
        out, limit = tmp_path / "shards", str(4 * HIDDEN * HIDDEN * 4)
        state = converted([script, ckpt, out, "-t", "global_step2", "--max_shard_size", limit], out)
        index = json.loads((out / "pytorch_model.bin.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2
        n = len(shards)
        assert shards == [f"pytorch_model-{i:05d}-of-{n:05d}.bin" for i in range(1, n + 1)]
        assert sorted(os.listdir(out)) == sorted([*shards, "pytorch_model.bin.index.json"])
        assert index["metadata"]["total_size"] == sum(
            v.nbytes for k, v in first.items() if k != "head.weight"
        )
        assert_equal(state, first)

        out = tmp_path / "trained"
        state = converted(
            [script, ckpt, out, "--exclude_frozen_parameters", "--safe_serialization", "-d"], out
        )
        frozen = {"blocks.0.norm.weight", "blocks.0.norm.bias", "head.weight"}
        assert_equal(state, {k: v for k, v in later.items() if k not in frozen})

    def test_a_pipeline_engines_folder(self, tmp_path: Path) -> None:
        engine = pipe_initialize(pipeline(2), pipe_config(zero_optimization={"stage": 1}))
        pipe_train(engine, global_batches(2, 8))
        ckpt = tmp_path / "ckpt"
        engine.save_checkpoint(ckpt)
        # fp32 training: the module's weights are the masters; each stage says its own
        torch.save(engine.module.state_dict(), tmp_path / f"stage{engine.stage_id}.pt")
        zcomm.barrier()
        if zcomm.get_rank() != 0:
            return
        assert not (ckpt / "stage0" / SCRIPT).exists()
        expected = {}
        for stage in (1, 0):  # a tied weight: stage 0's copy (equal on both)
            expected.update(torch.load(tmp_path / f"stage{stage}.pt", weights_only=True))
        assert "tied_modules.embed.weight" in expected
        state = converted([SCRIPT, ".", tmp_path / "out"], tmp_path / "out", ckpt, here=False)
        assert_equal(state, expected)


def test_deepspeeds_own_checkpoint(tmp_path: Path) -> None:
    """The script reads a folder DeepSpeed saved (ZeRO-3, 2 ranks, tied and frozen weights and
    a buffer), giving what zengine's reader gives, in shards as DeepSpeed names them."""
    script = write_recovery_script(tmp_path)
    fixture = FIXTURES / "stage3_fp32_ws2"
    expected = fp32_state_dict(fixture)
    out = tmp_path / "out"
    state = converted([script, fixture, out, "--max_shard_size", "1KB"], out)
    assert sorted(os.listdir(out)) == [
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], v) for k, v in expected.items())


def test_a_folder_without_a_checkpoint_is_named(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    script = write_recovery_script(tmp_path)
    done = run([script, tmp_path / "empty", tmp_path / "out"])
    assert done.returncode == 1
    assert "no checkpoint here" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    fixture = FIXTURES / "stage3_fp32_ws2"
    done = run_here([script, fixture, tmp_path / "out", "--tag", "global_step9"])
    assert done.returncode == 1
    assert "global_step9" in done.stderr, done.stderr
    done = run_here([script, fixture, tmp_path / "out", "--max_shard_size", "5 parsecs"])
    assert done.returncode == 1
    assert "max_shard_size" in done.stderr, done.stderr
    done = run_here([script, fixture])  # no output folder: argparse's usage error
    assert done.returncode == 2
    assert "output_dir" in done.stderr, done.stderr


def test_a_script_that_cannot_import_zengine_says_so(tmp_path: Path) -> None:
    script = write_recovery_script(tmp_path)
    done = subprocess.run(
        [sys.executable, "-I", "-S", script, ".", "out"],  # no site-packages: no zengine
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 1
    assert "needs the zengine package" in done.stderr, done.stderr


def test_a_file_system_that_refuses_chmod_does_not_fail_the_save(tmp_path: Path) -> None:
    """DeepSpeed's ``_change_recovery_script_permissions``: on a share that refuses (here a
    path that is not there, as DeepSpeed's test uses) the log says so and nothing raises."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("zengine")
    logger.addHandler(handler)
    try:
        change_permissions(tmp_path / "gone" / SCRIPT)
    finally:
        logger.removeHandler(handler)
    assert any("Could not change permissions" in m for m in said), said


@pytest.mark.parametrize("size", ["1KB", "0.2KB", "1MB"])
def test_shards_split_as_hugging_face_splits(size: str, tmp_path: Path) -> None:
    """The same files and index as huggingface_hub's split_torch_state_dict_into_shards, which
    DeepSpeed's zero_to_fp32 calls, for the state dict in the order zstack writes it (model
    order; DeepSpeed's puts buffers and frozen weights first)."""
    hub = pytest.importorskip("huggingface_hub")
    fixture = FIXTURES / "stage3_fp32_ws2"
    expected = fp32_state_dict(fixture)
    convert_zero_checkpoint_to_fp32_state_dict(fixture, tmp_path / "out", max_shard_size=size)
    split = hub.split_torch_state_dict_into_shards(
        expected, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=size
    )
    index_file = ["pytorch_model.bin.index.json"] if split.is_sharded else []
    assert sorted(os.listdir(tmp_path / "out")) == sorted([*split.filename_to_tensors, *index_file])
    if split.is_sharded:
        index = json.loads((tmp_path / "out" / "pytorch_model.bin.index.json").read_text())
        assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}


@pytest.mark.deepspeed
def test_deepspeeds_functions_and_arguments_are_ours() -> None:
    """Beside the real DeepSpeed (nox -s interop): its zero_to_fp32's functions take the
    arguments ours take, with the same defaults, and its command line the same options."""
    import inspect

    import deepspeed.utils.zero_to_fp32 as theirs
    import zengine.utils.zero_to_fp32 as ours

    for name in (
        "convert_zero_checkpoint_to_fp32_state_dict",
        "get_fp32_state_dict_from_zero_checkpoint",
        "load_state_dict_from_zero_checkpoint",
    ):
        mine, deepspeeds = (inspect.signature(getattr(m, name)) for m in (ours, theirs))
        assert [(p.name, p.default) for p in mine.parameters.values()] == [
            (p.name, p.default) for p in deepspeeds.parameters.values()
        ], name

    def options(module: str) -> set[str]:
        done = run(["-m", module, "--help"])
        assert done.returncode == 0, done.stderr
        usage = done.stdout[done.stdout.index("usage:") :].split("\n\n")[0]  # DeepSpeed logs first
        return set(re.findall(r"-{1,2}[\w-]+|\b\w+_dir\b", usage))

    assert options("zengine.utils.zero_to_fp32") == options("deepspeed.utils.zero_to_fp32")
