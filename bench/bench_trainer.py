"""Transformers' `Trainer` at ZeRO-3 on zstack (through the DeepSpeed compatibility package)
against the same `Trainer` with DDP, on CPU.

Run by ``nox -s bench -- trainer`` (or ``python bench/bench_trainer.py [--quick]``).

The model is a Llama built from a ``transformers.LlamaConfig`` (vocab 8192, hidden 256,
intermediate 688, 4 layers, 8 heads, 4 key-value heads, fp32, about 6.7 M parameters), its
weights saved once and loaded by every run; sequence 256, micro-batch 4 per rank, no gradient
accumulation, AdamW (lr 1e-4), 2 ranks on gloo, one torch thread per rank. The two contenders
differ only in ``TrainingArguments``: DDP (``use_cpu=True``: Accelerate's MULTI_CPU, DDP on
gloo) and ZeRO-3 (``deepspeed={"zero_optimization": {"stage": 3}, ...}`` with Transformers'
"auto" values; the optimizer is the Trainer's own AdamW, wrapped by the engine). A callback times
each optimizer step (``on_step_begin`` to ``on_step_end``: forward, backward, step and the
Trainer's bookkeeping), wall and process CPU time; the first steps are warm-up. Each round starts
both contenders as fresh process groups, in alternating order; the figure is the median over
rounds of the ratio of the medians, ZeRO-3 over DDP. Target: at most 1.10x.
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


def _worker(model_dir: str, contender: str, steps: int, warmup: int) -> None:
    import torch
    import transformers
    from accelerate import PartialState

    torch.set_num_threads(1)
    zero3 = contender == "zero3"
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
    args = transformers.TrainingArguments(
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
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[Timer()]
    )
    trainer.train()
    timed = times[warmup:]
    result = {
        "wall": statistics.median(t[0] for t in timed),
        "cpu": statistics.median(t[1] for t in timed),
    }
    print("RESULT " + json.dumps(result), flush=True)


def _save_model(path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=688,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    print(f"Llama: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
    model.save_pretrained(path)


def main() -> None:
    quick = "--quick" in sys.argv
    rounds, steps, warmup = (2, 6, 2) if quick else (5, 14, 4)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        _save_model(model_dir)
        ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
        medians: dict[str, dict[str, list[float]]] = {
            c: {"wall": [], "cpu": []} for c in ("ddp", "zero3")
        }
        for round_ in range(rounds):
            order = ("ddp", "zero3") if round_ % 2 == 0 else ("zero3", "ddp")
            found: dict[str, dict[str, float]] = {}
            for contender in order:
                ranks = run_ranks(
                    __file__,
                    ["--worker", str(model_dir), contender, str(steps), str(warmup)],
                    world=2,
                )
                # a step is as slow as its slower rank
                found[contender] = {
                    kind: max(float(str(rank[kind])) for rank in ranks) for kind in ("wall", "cpu")
                }
            for kind in ("wall", "cpu"):
                ratios[kind].append(found["zero3"][kind] / found["ddp"][kind])
                for contender in found:
                    medians[contender][kind].append(found[contender][kind])
            print(
                f"round {round_ + 1}/{rounds}: ZeRO-3 / DDP wall {ratios['wall'][-1]:.3f}x, "
                f"CPU {ratios['cpu'][-1]:.3f}x",
                flush=True,
            )
    print(
        f"\n### Trainer step, Llama {HIDDEN}x{LAYERS}, world size 2 (gloo, micro-batch {MICRO}, "
        f"sequence {SEQ}): ms per step, medians of {rounds} rounds x {steps - warmup} steps"
    )
    print("\n| | DDP | ZeRO-3 (zstack via `deepspeed`) | ZeRO-3 / DDP |")
    print("|---|---|---|---|")
    for kind in ("wall", "cpu"):
        ddp = statistics.median(medians["ddp"][kind]) * 1e3
        zero3 = statistics.median(medians["zero3"][kind]) * 1e3
        ratio = statistics.median(ratios[kind])
        print(f"| {kind} time | {ddp:.1f} | {zero3:.1f} | {ratio:.3f}x |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
