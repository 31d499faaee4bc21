"""Transformers' own ZeRO-3 code paths, run on zstack through ``import deepspeed``.

A live ``transformers.integrations.HfDeepSpeedConfig`` switches Transformers to its DeepSpeed
ZeRO-3 paths (``deepspeed.zero.Init`` while the model is built, rank 0 reading the checkpoint
and ``GatheredParameters(..., modifier_rank=0)`` to load it, ``initialize_weights_zero3``,
gathered resizing, ``synced_gpus`` generation). Each test builds tiny models from configs
(nothing downloaded) and compares with what the same Transformers does on a plain model:
bit-exact where the arithmetic is the same, with tolerances only where Transformers itself
takes another code path (said where).

The pool's worker processes run one test after another, so every test unsets the
HfDeepSpeedConfig it made (`zero3`) before it returns, and the checkpoints saved by rank 0 go
to the class's shared directory (``class_tmpdir``), reused by the tests of the class.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import deepspeed
import zpartition
from _helpers import VOCAB, tiny_config
from unit.common import DistributedTest

WORLD_SIZES = [1, 2, 4]
# What a Transformers user hands HfDeepSpeedConfig for ZeRO-3 (what zero.Init is given).
HF_ZERO3: dict[str, Any] = {
    "zero_optimization": {"stage": 3},
    "train_micro_batch_size_per_gpu": 1,
}
# The engine's: no parameter is persistent (DeepSpeed's default threshold, 1e5 elements, would
# keep every parameter of these tiny models whole, and nothing would be gathered per module).
ENGINE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
TRAIN: dict[str, Any] = {
    **ENGINE,
    "zero_optimization": {
        **ENGINE["zero_optimization"],
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
}
KINDS = ["llama", "gpt2", "mixtral"]


# ---------------------------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def zero3(config: dict[str, Any] | None = None) -> Iterator[Any]:
    """Transformers' ZeRO-3 switch: a live HfDeepSpeedConfig, held here and unset on the way
    out (Transformers keeps only a weak reference, in a module global the next test would
    see)."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import (
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    hf_config = HfDeepSpeedConfig(copy.deepcopy(config or HF_ZERO3))
    try:
        assert is_deepspeed_zero3_enabled()
        yield hf_config
    finally:
        unset_hf_deepspeed_config()


def zero3_off() -> None:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled(), "an HfDeepSpeedConfig is alive where none should be"


def checkpoint(root: Any, kind: str, *, max_shard_size: str | None = None) -> Path:
    """A seeded tiny `kind` causal LM saved (safetensors) under the class's shared directory
    by rank 0, once for the whole class; every rank returns its path."""
    path = Path(str(root)) / (f"{kind}-sharded" if max_shard_size else kind)
    done = path / ".complete"
    if dist.get_rank() == 0 and not done.exists():
        import transformers

        zero3_off()
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
        if max_shard_size is None:
            model.save_pretrained(path)
        else:
            model.save_pretrained(path, max_shard_size=max_shard_size)
        done.touch()
    dist.barrier()
    return path


def load(path: Path) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path)``: under ZeRO-3 inside `zero3`, plainly
    outside it."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path)


def plain(path: Path) -> Any:
    """The checkpoint loaded the ordinary way (no HfDeepSpeedConfig alive), in eval mode."""
    zero3_off()
    return load(path).eval()


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full (copies), by name (a tied parameter once)."""
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: p.data.detach().clone() for name, p in model.named_parameters()}


def safetensors_in(path: Path) -> dict[str, torch.Tensor]:
    """What the directory's safetensors files hold, read with the safetensors package."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    assert state, f"no safetensors file in {path}"
    return state


def assert_equal(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    """Same names, and bit-identical tensors (shape and dtype included)."""
    assert set(got) == set(expected), (
        f"{what}: names differ: only got {sorted(set(got) - set(expected))}, "
        f"only expected {sorted(set(expected) - set(got))}"
    )
    wrong = [
        f"{name} (max |diff| {(got[name].double() - t.double()).abs().max().item():.3g})"
        if got[name].shape == t.shape
        else f"{name} (shape {tuple(got[name].shape)} != {tuple(t.shape)})"
        for name, t in expected.items()
        if not (got[name].dtype == t.dtype and torch.equal(got[name], t))
    ]
    assert not wrong, f"{what}: not bit-identical: {wrong}"


def assert_partitioned(model: torch.nn.Module) -> None:
    """Every parameter is a ZeRO-3 parameter holding only its shard."""
    world = dist.get_world_size()
    whole = [name for name, p in model.named_parameters() if not hasattr(p, "ds_id")]
    assert not whole, f"not partitioned: {whole}"
    for name, p in model.named_parameters():
        shard = p.ds_tensor.numel()  # type: ignore[attr-defined]
        assert shard == math.ceil(p.ds_numel / world), (name, shard, p.ds_numel)  # type: ignore[attr-defined]
        if not p.ds_persist:  # type: ignore[attr-defined]
            assert p.data.numel() == 0, f"{name} holds {p.data.numel()} elements outside a pass"


def rank_batch(size: int, length: int = 12, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """This rank's batch of `size` random token sequences (each rank its own)."""
    generator = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    return torch.randint(0, vocab, (size, length), generator=generator)


def engine_for(model: torch.nn.Module, config: dict[str, Any]) -> Any:
    engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(config))
    return engine


# ---------------------------------------------------------------------------------------------
# 1. from_pretrained under partitioning


class TestFromPretrained(DistributedTest):
    world_size = WORLD_SIZES

    @pytest.mark.parametrize("kind", KINDS)
    def test_partitions_and_loads_bit_exactly(self, class_tmpdir: Any, kind: str) -> None:
        """Transformers' ZeRO-3 load (zero.Init, then rank 0 reads the files and each module
        is gathered with modifier_rank=0 and written) gives the checkpoint's exact values on
        every rank, from one file and from a sharded checkpoint. Mixtral's checkpoint holds
        per-expert weights that Transformers fuses while loading (its weight conversions,
        applied on the ZeRO-3 path by ``_apply_weight_conversions_to_state_dict``)."""
        for max_shard_size in (None, "20KB"):
            path = checkpoint(class_tmpdir, kind, max_shard_size=max_shard_size)
            files = sorted(path.glob("*.safetensors"))
            if max_shard_size is not None:
                assert len(files) > 1
                assert (path / "model.safetensors.index.json").exists()
            reference = plain(path)
            with zero3():
                model = load(path)
                assert_partitioned(model)
                if kind == "gpt2":  # the tied head stays one parameter
                    assert model.lm_head.weight is model.transformer.wte.weight
                got = gathered(model)
                buffers = {n: b.clone() for n, b in model.named_buffers()}
            where = f"{kind}, {len(files)} file(s)"
            assert_equal(got, dict(reference.named_parameters()), f"{where}: parameters")
            assert_equal(buffers, dict(reference.named_buffers()), f"{where}: buffers")
            saved = safetensors_in(path)
            same_names = {k: saved[k] for k in saved.keys() & got.keys()}
            if kind != "mixtral":  # every name as saved (Mixtral's experts are fused)
                assert len(same_names) == len(got), sorted(set(got) - set(saved))
            assert_equal({k: got[k] for k in same_names}, same_names, f"{where}: vs the files")


def _hwm_kib() -> int:
    found = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert found is not None
    return int(found.group(1))


def _rss_kib() -> int:
    found = re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert found is not None
    return int(found.group(1))


def _reset_peak_rss() -> None:
    """Free what can be freed, and start the peak (VmHWM) afresh at the current RSS: the pool's
    workers ran other tests before, whose peaks would hide this one's."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


class TestFromPretrainedMemory(DistributedTest):
    world_size = 2

    def test_peak_rss_per_rank(self, class_tmpdir: Any) -> None:
        """Each rank's peak RSS increase during a ZeRO-3 from_pretrained of a ~70 MB (fp32)
        Llama. In Transformers' design rank 0 reads the whole checkpoint (memory-mapped; every
        page is touched as it is copied in) and the others only its keys and shapes (meta
        tensors). Each rank keeps its 1/world of the shards, and holds one module gathered at a
        time. So at 2 ranks: rank 0 below 2x the model (the checkpoint 1x, its shards 0.5x,
        0.5x for the rest), the others below 0.75x (0.5x shards, 0.25x for the rest).
        No timing is asserted."""
        import transformers

        path = Path(str(class_tmpdir)) / "llama-70MB"
        config = transformers.LlamaConfig(
            vocab_size=2048,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=64,
        )
        if dist.get_rank() == 0:
            zero3_off()
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        dist.barrier()
        model_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        assert 50e6 < model_bytes < 100e6, model_bytes
        tiny = checkpoint(class_tmpdir, "llama")
        with zero3():  # the same code path once on a tiny model: imports, first-call caches
            load(tiny)
        with zero3():
            _reset_peak_rss()
            before = _rss_kib()
            dist.barrier()
            model = load(path)
            peak = (_hwm_kib() - before) * 1024
            assert_partitioned(model)
        peaks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        print(f"model {model_bytes / 2**20:.1f} MiB; peak RSS increase per rank (MiB): ", end="")
        print(", ".join(f"{p / 2**20:.1f}" for p in peaks))
        shards = model_bytes / dist.get_world_size()
        assert peaks[0] < model_bytes + shards + 0.5 * model_bytes, (
            f"rank 0 peaked at {peaks[0] / model_bytes:.2f}x the model"
        )
        for rank, rank_peak in enumerate(peaks[1:], start=1):
            assert rank_peak < shards + 0.25 * model_bytes, (
                f"rank {rank} peaked at {rank_peak / model_bytes:.2f}x the model"
            )


# ---------------------------------------------------------------------------------------------
# 2. from_config


class TestFromConfig(DistributedTest):
    world_size = WORLD_SIZES

    @pytest.mark.parametrize("kind", KINDS)
    def test_initialises_partitioned_weights(self, kind: str) -> None:
        """``from_config`` under ZeRO-3 builds under zero.Init with Transformers' init switched
        off, then runs ``initialize_weights_zero3`` (each module gathered with modifier_rank=0,
        rank 0 initialises): the gathered weights have the statistics of the same
        Transformers' plain initialisation (other random draws: statistics, not values), and
        the first loss is ln(vocab), as it is for a freshly initialised model."""
        import transformers

        config = tiny_config(kind)
        zero3_off()
        torch.manual_seed(0)
        reference = dict(transformers.AutoModelForCausalLM.from_config(config).named_parameters())
        with zero3():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config)
            assert_partitioned(model)
            got = gathered(model)
            assert set(got) == set(reference)
            for name, t in got.items():
                expected = reference[name]
                assert t.shape == expected.shape, name
                assert torch.isfinite(t).all(), name
                if expected.std() == 0 or expected.numel() == 1:  # ones, zeros: exact
                    assert torch.equal(t, expected), name
                    continue
                # a random draw: same spread (1.2x apart at most) and a mean near zero
                ratio = (t.std() / expected.std()).item()
                assert 1 / 1.2 < ratio < 1.2, (
                    f"{name}: std {t.std():.4g}, plain {expected.std():.4g}"
                )
                assert abs(t.mean().item()) < 0.25 * expected.std().item(), name
            std = config.initializer_range
            for name, t in got.items():  # the initializer's own numbers, where Llama sets them
                if kind == "llama" and t.dim() == 2:
                    assert abs(t.std().item() - std) < 0.15 * std, name
                if kind == "llama" and "norm" in name:
                    assert torch.equal(t, torch.ones_like(t)), name
            engine = engine_for(model, ENGINE)
            engine.eval()
            batch = rank_batch(2)
            with torch.no_grad():
                loss = engine(input_ids=batch, labels=batch).loss.item()
            assert abs(loss - math.log(VOCAB)) < 0.1, (
                f"first loss {loss}, ln(vocab) {math.log(VOCAB)}"
            )
            engine.destroy()


# ---------------------------------------------------------------------------------------------
# 3. resize_token_embeddings


class TestResizeTokenEmbeddings(DistributedTest):
    world_size = WORLD_SIZES

    @pytest.mark.parametrize("kind", ["llama", "gpt2"])
    def test_resize_then_train(self, class_tmpdir: Any, kind: str) -> None:
        """Bigger (150 -> 160 with pad_to_multiple_of=16) and smaller (100 -> 104 with 8).
        Transformers' ZeRO-3 resize builds the new embedding (and Llama's untied head) as plain
        modules, fills them inside GatheredParameters and draws the added rows around the old
        rows' mean (covariance 1e-9 times theirs) as its plain path does, with the same random
        numbers: on rank 0, seeded as the plain model, bit-identical to the plain resize. The
        other ranks draw with their own seeds here (as ranks may), and the engine then makes
        the new parameters rank 0's when it partitions them: bit-identical everywhere."""
        rank = dist.get_rank()
        path = checkpoint(class_tmpdir, kind)
        embed_name = "model.embed_tokens.weight" if kind == "llama" else "transformer.wte.weight"
        saved = safetensors_in(path)
        for asked, multiple in ((150, 16), (100, 8)):
            size = math.ceil(asked / multiple) * multiple
            reference = plain(path)
            torch.manual_seed(1)
            reference.resize_token_embeddings(asked, pad_to_multiple_of=multiple)
            assert reference.config.vocab_size == size
            expected = dict(reference.named_parameters())
            with zero3():
                model = load(path)
                torch.manual_seed(1 + rank)
                model.resize_token_embeddings(asked, pad_to_multiple_of=multiple)
                assert model.config.vocab_size == size
                head = model.get_output_embeddings().weight
                if kind == "gpt2":
                    assert head is model.get_input_embeddings().weight
                got = gathered(model)
                resized = [embed_name] if kind == "gpt2" else [embed_name, "lm_head.weight"]
                for name in resized:
                    old = saved[name]
                    assert got[name].shape == (size, 64), (name, got[name].shape)
                    kept = min(size, VOCAB)
                    assert torch.equal(got[name][:kept], old[:kept]), name
                    if size > VOCAB:
                        added = got[name][VOCAB:]
                        gap = (added - old.mean(0)).abs().max().item()
                        assert torch.isfinite(added).all(), name
                        assert gap < 1e-5, (name, gap)
                if rank == 0:
                    assert_equal(got, expected, f"{kind} resized to {size} (rank 0)")
                unchanged = {k: v for k, v in expected.items() if k not in resized}
                assert_equal({k: got[k] for k in unchanged}, unchanged, "the other weights")

                engine = engine_for(model, TRAIN)
                assert_partitioned(engine.module)
                assert_equal(gathered(engine.module), expected, f"{kind} resized, partitioned")
                batch = rank_batch(2, vocab=size, seed=size)
                engine.eval()
                with torch.no_grad():
                    loss = engine(input_ids=batch, labels=batch).loss
                    plain_loss = reference(input_ids=batch, labels=batch).loss
                # the same forward arithmetic on the gathered weights: bit-identical
                assert torch.equal(loss, plain_loss), (loss.item(), plain_loss.item())
                engine.train()
                for _ in range(2):
                    loss = engine(input_ids=batch, labels=batch).loss
                    assert torch.isfinite(loss)
                    engine.backward(loss)
                    engine.step()
                trained = gathered(engine.module)[embed_name]
                used = torch.unique(batch)
                assert not torch.equal(trained[used], expected[embed_name][used]), "no step taken"
                engine.destroy()


# ---------------------------------------------------------------------------------------------
# 4. generate with synced_gpus


def _generate(model: Any, prompt: torch.Tensor, how: str, **kwargs: Any) -> Any:
    # printed first, so a rank killed for hanging shows in its log what it was doing
    print(f"generate ({how}): prompt of {prompt.shape[1]} tokens, {kwargs}", flush=True)
    out = model.generate(
        prompt,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    print(f"generate ({how}): {out.sequences.shape[1] - prompt.shape[1]} new tokens", flush=True)
    return out


class TestGenerate(DistributedTest):
    world_size = WORLD_SIZES
    # Ranks out of step in synced_gpus generation would hang in a collective: the harness kills
    # the test after this many seconds and names it with each stuck rank's stack.
    exec_timeout = 90.0

    @pytest.mark.parametrize("kind", ["llama", "mixtral"])
    def test_synced_gpus_ranks_finish_apart(self, class_tmpdir: Any, kind: str) -> None:
        """Rank r has a prompt of 3 + 2r tokens and asks for up to 4 + 3r new ones, and odd
        ranks stop early at an EOS token taken from their own plain run, so the ranks finish
        at different steps: with ``synced_gpus=True`` the finished ones keep joining the
        forward passes. Each rank's tokens and logits equal the plain model's (greedy), on
        the partitioned model (zpartition's hooks), on the engine's module, and inside
        ``deepspeed.zero.unwrap_model_for_generation(engine)``. Mixtral: the ranks route
        their tokens to different experts (its experts are one module, gathered whole)."""
        path = checkpoint(class_tmpdir, kind)
        rank = dist.get_rank()
        generator = torch.Generator().manual_seed(100 + rank)
        prompt = torch.randint(3, VOCAB, (1, 3 + 2 * rank), generator=generator)
        kwargs: dict[str, Any] = {"max_new_tokens": 4 + 3 * rank, "pad_token_id": 0}
        reference = plain(path)
        if rank % 2 == 1:
            longest = reference.generate(prompt, do_sample=False, **kwargs)
            kwargs["eos_token_id"] = int(longest[0, prompt.shape[1] + 1])
        expected = _generate(reference, prompt, "plain", **kwargs)
        new_tokens = expected.sequences.shape[1] - prompt.shape[1]
        if rank % 2 == 1:
            assert new_tokens <= 2, "the EOS token did not stop the plain run early"

        def check(out: Any, how: str) -> None:
            assert torch.equal(out.sequences, expected.sequences), (
                f"{how}: {out.sequences.tolist()} != {expected.sequences.tolist()}"
            )
            assert len(out.logits) == len(expected.logits)
            for step, (a, b) in enumerate(zip(out.logits, expected.logits, strict=True)):
                assert torch.equal(a, b), f"{how}: logits differ at step {step}"

        with zero3():
            model = load(path).eval()
            handle = zpartition.partition(
                model, config=zpartition.ZeroParamConfig(param_persistence_threshold=0)
            )
            check(
                _generate(model, prompt, "partitioned", synced_gpus=True, **kwargs), "partitioned"
            )
            handle.remove(gather=False)

            engine = engine_for(load(path), ENGINE)
            engine.eval()
            module = engine.module
            if kind == "mixtral":  # DeepSpeed's default zero_optimization.leaf_module classes
                moe = [m for m in module.modules() if type(m).__name__ == "MixtralSparseMoeBlock"]
                assert moe
                assert all(deepspeed.utils.z3_leaf_module(m) for m in moe)
            check(_generate(module, prompt, "engine", synced_gpus=True, **kwargs), "engine.module")
            with deepspeed.zero.unwrap_model_for_generation(engine) as unwrapped:
                out = _generate(unwrapped.module, prompt, "unwrapped", synced_gpus=True, **kwargs)
            check(out, "unwrap_model_for_generation")
            # Transformers turns synced_gpus on by itself under ZeRO-3 with several ranks
            check(_generate(module, prompt, "engine, default synced_gpus", **kwargs), "default")
            engine.destroy()
        lengths: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(lengths, new_tokens)
        if dist.get_world_size() > 1:
            assert len(set(lengths)) > 1, f"the ranks generated {lengths} tokens: not apart"


# ---------------------------------------------------------------------------------------------
# 5. save_pretrained under ZeRO-3


class TestSave(DistributedTest):
    world_size = WORLD_SIZES

    @pytest.mark.parametrize("kind", KINDS)
    def test_saved_weights_load_plainly(self, class_tmpdir: Any, kind: str) -> None:
        """After two training steps, (a) Transformers' way for ZeRO-3 (gather every parameter,
        ``save_pretrained(dir, state_dict=...)`` on rank 0) and (b) ``engine.save_16bit_model``
        (fp32 model: its compute dtype is fp32) write what a plain from_pretrained, and the
        safetensors package, read back bit-identical to the gathered weights. Mixtral: the
        plain loader fuses the per-expert weights save_pretrained wrote, and takes the fused
        ones save_16bit_model wrote as they are."""
        rank, world = dist.get_rank(), dist.get_world_size()
        path = checkpoint(class_tmpdir, kind)
        out = Path(str(class_tmpdir)) / f"saved-{kind}-{world}"
        by_hf, by_engine = out / "save_pretrained", out / "save_16bit_model"
        with zero3():
            engine = engine_for(load(path), TRAIN)
            module = engine.module
            for step in range(2):
                batch = rank_batch(2, seed=step)
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
            expected = gathered(module)
            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                if rank == 0:
                    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
                    module.save_pretrained(by_hf, state_dict=state)
            assert engine.save_16bit_model(by_engine, "model.safetensors")
            if rank == 0:
                module.config.save_pretrained(by_engine)
            dist.barrier()
            engine.destroy()
        before = dict(plain(path).named_parameters())
        changed = [n for n, t in expected.items() if not torch.equal(t, before[n])]
        assert len(changed) == len(expected), "training left some weights as they were"
        for where in (by_hf, by_engine):
            assert_equal(dict(plain(where).named_parameters()), expected, f"{where.name}: loaded")
            files = safetensors_in(where)
            assert_equal(
                {k: files[k] for k in expected.keys() & files.keys()},
                {k: expected[k] for k in expected.keys() & files.keys()},
                f"{where.name}: the file",
            )
            # save_pretrained writes Mixtral's experts one by one, as its checkpoints hold them
            # (Transformers reverses its load-time fusion); save_16bit_model the model's names
            if kind != "mixtral" or where is by_engine:
                assert len(expected.keys() & files.keys()) == len(expected), (
                    f"{where.name}: missing {sorted(set(expected) - set(files))}"
                )
