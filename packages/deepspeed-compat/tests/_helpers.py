"""What the compatibility package's tests share: tiny Hugging Face models built from configs
(nothing downloaded), runs of the scripts in ``scripts/`` under ``torchrun``, and what those
scripts share (they import this module by path): Accelerate's DeepSpeed state on a CPU
machine, the data, and writing rank 0's findings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SCRIPTS",
    "TokenDataset",
    "hf_zero_config",
    "save_tiny_model",
    "tiny_config",
    "token_batches",
    "torchrun",
    "use_deepspeed_state",
    "write_result",
]

SCRIPTS = Path(__file__).parent / "scripts"
VOCAB = 128


def tiny_config(kind: str = "llama", **overrides: Any) -> Any:
    """A few-layer config of `kind` ("llama", "gpt2", "t5", "mixtral", "bert"), with
    `overrides` of its keys."""
    import transformers

    common: dict[str, Any] = {"vocab_size": VOCAB, **overrides}
    if kind == "llama":
        return transformers.LlamaConfig(
            **common,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    if kind == "gpt2":
        return transformers.GPT2Config(**common, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **common,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
    if kind == "t5":
        return transformers.T5Config(
            **common, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4
        )
    if kind == "bert":
        return transformers.BertConfig(
            **common,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
    raise ValueError(f"tiny_config: unknown kind {kind!r}")


def save_tiny_model(path: Path, kind: str = "llama", seed: int = 0) -> Path:
    """A causal LM of `kind` with seeded weights, saved (safetensors) to `path`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
    model.save_pretrained(path)
    return path


def token_batches(count: int, batch: int, length: int = 16, seed: int = 0) -> torch.Tensor:
    """`count` x `batch` sequences of random token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (count, batch, length), generator=generator)


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 600) -> dict[str, Any]:
    """Run ``scripts/<script>`` under ``torchrun --nproc-per-node <nproc>``; it writes what rank
    0 found as JSON to the file named by ``ZSTACK_RESULT``, which is returned. A failure raises
    with the ranks' output."""
    result = Path(args[0]) / f"{Path(script).stem}.json" if args else None
    assert result is not None, "torchrun: the first argument is the run's directory"
    env = {**os.environ, "ZSTACK_RESULT": str(result), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        str(SCRIPTS / script),
        *args,
    ]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0 or not result.exists():
        raise AssertionError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-6000:]}\n"
            f"{done.stderr[-12000:]}"
        )
    loaded: dict[str, Any] = json.loads(result.read_text())
    return loaded


# -- in the torchrun scripts -------------------------------------------------------------------


def hf_zero_config(stage: int) -> dict[str, Any]:
    """Transformers' documented ZeRO config at `stage`: "auto" wherever the Trainer knows the
    value (a fresh dict each call: the Trainer fills it in place)."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }


def use_deepspeed_state(enabled: bool) -> None:
    """Make Accelerate's process state afresh, for DeepSpeed or not.

    Accelerate picks DeepSpeed only on a machine with an accelerator unless the process group's
    backend is named: without one it counts each rank as a world of one. On CPU the state is
    made here, naming gloo, and Transformers is told to use it (``use_configured_state``)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    unset_hf_deepspeed_config()
    # TrainingArguments(deepspeed=...) sets this and leaves it: a later Trainer without
    # DeepSpeed in the same process would run DeepSpeed
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    if enabled:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    else:
        PartialState(cpu=True, backend="gloo")


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the same on every rank; labels are the inputs (causal LM)."""

    def __init__(self, samples: int = 64, length: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def write_result(result: dict[str, Any]) -> None:
    """Rank 0's findings, as JSON, where the test reads them."""
    if int(os.environ.get("RANK", "0")) == 0:
        Path(os.environ["ZSTACK_RESULT"]).write_text(json.dumps(result, indent=1))
