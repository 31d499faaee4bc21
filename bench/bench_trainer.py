"""Transformers' `Trainer` at ZeRO-3 on zstack (through the DeepSpeed compatibility package)
against the same `Trainer` with DDP, on CPU, for four models.

Run by ``nox -s bench -- trainer`` (or ``python bench/bench_trainer.py [--quick]
[--only=llama,lora,t5,moe] [--rounds=N]``).

The models are built from Transformers configs (nothing downloaded), their weights seeded and
saved once and loaded by every run, fp32: a Llama (vocab 8192, hidden 256, intermediate 688, 4
layers, 8 heads, 4 key-value heads, 7.1 M parameters); the same Llama under PEFT's LoRA (rank
16 on q_proj and v_proj, the base frozen); a T5 (d_model 256, d_ff 688, 4 encoder and 4 decoder
blocks, 8 heads of 32); and a Mixtral (the Llama's shape with 4 experts of intermediate 344, 2
per token). Sequence 256, micro-batch 4 per rank, no gradient accumulation, AdamW (lr 1e-4), 2
ranks on gloo, one torch thread per rank. The runs differ only in ``TrainingArguments``: DDP
(``use_cpu=True``: Accelerate's MULTI_CPU, DDP on gloo) and ZeRO-3
(``deepspeed={"zero_optimization": {"stage": 3}, ...}``) with the "auto" sizes of
Transformers' documented configs (``reduce_bucket_size`` hidden^2,
``stage3_prefetch_bucket_size`` 0.9 hidden^2, ``stage3_param_persistence_threshold`` 10
hidden), and for the Llama also with DeepSpeed's default sizes; the optimizer is the Trainer's
own AdamW, wrapped by the engine. A callback times each optimizer step (``on_step_begin`` to
``on_step_end``: forward, backward, step and the Trainer's bookkeeping), wall and process CPU
time; the first steps are warm-up. Each round starts every run as a fresh process group, in
rotating order; a model's figure is the median over rounds of the ratio of its ZeRO-3 median
to its own DDP median in the same round. Target: at most 1.10x. The table also gives the units
ZeRO-3 gathers (zpartition's [Note: module groups]: one per decoder layer or block).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import run_ranks

VOCAB, HIDDEN, LAYERS, SEQ, MICRO = 8192, 256, 4, 256, 4
# The models, each built from a config once and saved: name -> (label, saved model it loads).
MODELS = {
    "llama": ("Llama", "llama"),
    "lora": ("Llama with PEFT LoRA", "llama"),
    "t5": ("T5", "t5"),
    "moe": ("Mixtral MoE", "moe"),
}
# (model, run): each model under DDP and under ZeRO-3 with the "auto" sizes; the Llama also with
# DeepSpeed's default sizes.
CONTENDERS = [
    ("llama", "ddp"),
    ("llama", "zero3"),
    ("llama", "zero3-defaults"),
    ("lora", "ddp"),
    ("lora", "zero3"),
    ("t5", "ddp"),
    ("t5", "zero3"),
    ("moe", "ddp"),
    ("moe", "zero3"),
]
RUNS = {
    "ddp": "DDP",
    "zero3": 'ZeRO-3, Transformers\' "auto" sizes',
    "zero3-defaults": "ZeRO-3, DeepSpeed's default sizes",
}


def _worker(models_dir: str, model_name: str, run: str, steps: int, warmup: int) -> None:
    import torch
    import transformers
    from accelerate import PartialState

    torch.set_num_threads(1)
    zero3 = run.startswith("zero3")
    if zero3:  # on CPU Accelerate counts DeepSpeed ranks only with the backend named
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, VOCAB, (64 * MICRO, SEQ), generator=generator)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            # T5 takes the same tokens as its encoder's input and its decoder's labels
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    times: list[tuple[float, float]] = []

    class Timer(transformers.TrainerCallback):  # type: ignore[misc]  # untyped library
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = (time.perf_counter(), time.process_time())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            wall, cpu = self.start
            times.append((time.perf_counter() - wall, time.process_time() - cpu))

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    if run == "zero3-defaults":  # DeepSpeed's own defaults for the sizes
        ds_config["zero_optimization"] = {"stage": 3}
    args = transformers.TrainingArguments(  # made first: with DeepSpeed it switches ZeRO-3 on
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=MICRO,
        max_steps=steps,
        learning_rate=1e-4,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not zero3,
        ddp_backend="gloo",
        accelerator_config={"use_configured_state": zero3},
        deepspeed=ds_config if zero3 else None,
    )
    saved = Path(models_dir) / MODELS[model_name][1]
    model: Any
    if model_name == "t5":
        model = transformers.AutoModelForSeq2SeqLM.from_pretrained(saved)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(saved)
    if model_name == "lora":
        import peft

        # PEFT's usual LoRA on a causal LM (its default target modules for a Llama: q_proj and
        # v_proj), the base frozen; rank 16, so that the adapters (16 x 256) are partitioned
        # too under the "auto" persistence threshold (2 560 elements)
        lora = peft.LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.05,
            target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(model, lora)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[Timer()]
    )
    trainer.train()
    timed = times[warmup:]
    partitioned = getattr(trainer.model_wrapped, "partitioned", None)
    result = {
        "wall": statistics.median(t[0] for t in timed),
        "cpu": statistics.median(t[1] for t in timed),
        # the units ZeRO-3 gathers (persistent parameters are whole: not counted)
        "units": (
            sum(not u.persistent for u in partitioned.units) if partitioned is not None else 0
        ),
    }
    print("RESULT " + json.dumps(result), flush=True)


def _save_models(path: Path) -> dict[str, str]:
    """Each model built from its config with seeded weights and saved under `path`; returns a
    line describing each."""
    import torch
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": SEQ,
    }
    configs: dict[str, Any] = {
        "llama": transformers.LlamaConfig(**common, intermediate_size=688),
        # 4 experts of intermediate 344, 2 per token: a token's MLP compute is the Llama's
        "moe": transformers.MixtralConfig(
            **common, intermediate_size=344, num_local_experts=4, num_experts_per_tok=2
        ),
        # 4 encoder and 4 decoder blocks, 8 heads of 32, feed-forward 688
        "t5": transformers.T5Config(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            d_ff=688,
            d_kv=32,
            num_layers=LAYERS,
            num_heads=8,
            decoder_start_token_id=0,  # T5's pad token, where its decoder starts
            pad_token_id=0,
        ),
    }
    described = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        if name == "t5":
            model = transformers.AutoModelForSeq2SeqLM.from_config(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(path / name)
        described[name] = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters"
    described["lora"] = f"{described['llama']} frozen, LoRA adapters of rank 16 trained"
    return described


def main() -> None:
    quick = "--quick" in sys.argv
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
    contenders = [c for c in CONTENDERS if only is None or c[0] in only]
    if not contenders:
        raise SystemExit(f"--only names none of the models {list(MODELS)}")
    rounds, steps, warmup = (2, 6, 2) if quick else (6, 14, 4)
    rounds = int(next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--rounds=")), rounds))
    times: dict[tuple[str, str], dict[str, list[float]]] = {
        c: {"wall": [], "cpu": []} for c in contenders
    }
    ratios: dict[tuple[str, str], dict[str, list[float]]] = {
        c: {"wall": [], "cpu": []} for c in contenders
    }
    units: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models_dir = Path(tmp)
        described = _save_models(models_dir)
        for round_ in range(rounds):
            shift = round_ % len(contenders)
            order = contenders[shift:] + contenders[:shift]
            found: dict[tuple[str, str], dict[str, float]] = {}
            for model_name, run in order:
                ranks = run_ranks(
                    __file__,
                    ["--worker", str(models_dir), model_name, run, str(steps), str(warmup)],
                    world=2,
                )
                # a step is as slow as its slower rank
                found[model_name, run] = {
                    kind: max(float(str(rank[kind])) for rank in ranks) for kind in ("wall", "cpu")
                }
                units[model_name, run] = int(str(ranks[0]["units"]))
            for (model_name, run), kinds in found.items():
                for kind, value in kinds.items():
                    times[model_name, run][kind].append(value)
                    ratios[model_name, run][kind].append(value / found[model_name, "ddp"][kind])
            print(
                f"round {round_ + 1}/{rounds}: "
                + ", ".join(f"{m} {r} {found[m, r]['cpu'] * 1e3:.0f} ms CPU" for m, r in order),
                flush=True,
            )
    print(
        f"\n### Trainer step, world size 2 (gloo, micro-batch {MICRO}, sequence {SEQ}): ms per "
        f"step, medians of {rounds} rounds x {steps - warmup} steps; ratios are medians of the "
        "per-round ratio to the same model's DDP\n"
    )
    for name, (label, _) in MODELS.items():
        if only is None or name in only:
            print(f"- {label}: {described[name]}")
    print("\n| model | run | gathered units | wall ms | CPU ms | wall / DDP | CPU / DDP |")
    print("|---|---|---|---|---|---|---|")
    for model_name, run in contenders:
        wall, cpu = (statistics.median(times[model_name, run][k]) * 1e3 for k in ("wall", "cpu"))
        wall_ratio, cpu_ratio = (
            statistics.median(ratios[model_name, run][k]) for k in ("wall", "cpu")
        )
        print(
            f"| {MODELS[model_name][0]} | {RUNS[run]} | {units[model_name, run] or '-'} | "
            f"{wall:.1f} | {cpu:.1f} | {wall_ratio:.3f}x | {cpu_ratio:.3f}x |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
