"""Transformers' `Trainer` at ZeRO-3 on zstack (through the DeepSpeed compatibility package)
against the same `Trainer` with DDP, on CPU.

Run by ``nox -s bench -- trainer`` (or ``python bench/bench_trainer.py [--quick]``).

The model is a Llama built from a ``transformers.LlamaConfig`` (vocab 8192, hidden 256,
intermediate 688, 4 layers, 8 heads, 4 key-value heads, fp32, 7.1 M parameters), its weights
saved once and loaded by every run; sequence 256, micro-batch 4 per rank, no gradient
accumulation, AdamW (lr 1e-4), 2 ranks on gloo, one torch thread per rank. The contenders differ
only in ``TrainingArguments``: DDP (``use_cpu=True``: Accelerate's MULTI_CPU, DDP on gloo) and
ZeRO-3 (``deepspeed={"zero_optimization": {"stage": 3}, ...}``), twice: with the "auto" sizes
of Transformers' documented configs (``reduce_bucket_size`` hidden^2,
``stage3_prefetch_bucket_size`` 0.9 hidden^2, ``stage3_param_persistence_threshold`` 10 hidden)
and with DeepSpeed's default sizes; the optimizer is the Trainer's own AdamW, wrapped by the
engine. A callback times each optimizer step (``on_step_begin`` to ``on_step_end``: forward,
backward, step and the Trainer's bookkeeping), wall and process CPU time; the first steps are
warm-up. Each round starts every contender as a fresh process group, in rotating order; the
figure is the median over rounds of the ratio of the medians, ZeRO-3 over DDP. Target: at most
1.10x.
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
    zero3 = contender.startswith("zero3")
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
    if contender == "zero3-defaults":  # DeepSpeed's own defaults for the sizes
        ds_config["zero_optimization"] = {"stage": 3}
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


CONTENDERS = {
    "ddp": "DDP",
    "zero3": 'ZeRO-3, Transformers\' "auto" sizes',
    "zero3-defaults": "ZeRO-3, DeepSpeed's default sizes",
}


def main() -> None:
    quick = "--quick" in sys.argv
    rounds, steps, warmup = (2, 6, 2) if quick else (6, 14, 4)
    times: dict[str, dict[str, list[float]]] = {c: {"wall": [], "cpu": []} for c in CONTENDERS}
    ratios: dict[str, dict[str, list[float]]] = {c: {"wall": [], "cpu": []} for c in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        _save_model(model_dir)
        for round_ in range(rounds):
            order = list(CONTENDERS)[round_ % 3 :] + list(CONTENDERS)[: round_ % 3]
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
            for contender, kinds in found.items():
                for kind, value in kinds.items():
                    times[contender][kind].append(value)
                    ratios[contender][kind].append(value / found["ddp"][kind])
            print(
                f"round {round_ + 1}/{rounds}: "
                + ", ".join(f"{c} {found[c]['cpu'] * 1e3:.0f} ms CPU" for c in CONTENDERS),
                flush=True,
            )
    print(
        f"\n### Trainer step, Llama {HIDDEN}x{LAYERS}, world size 2 (gloo, micro-batch {MICRO}, "
        f"sequence {SEQ}): ms per step, medians of {rounds} rounds x {steps - warmup} steps; "
        "ratios are medians of the per-round ratio to DDP"
    )
    print("\n| | wall ms | CPU ms | wall / DDP | CPU / DDP |")
    print("|---|---|---|---|---|")
    for contender, label in CONTENDERS.items():
        wall, cpu = (statistics.median(times[contender][k]) * 1e3 for k in ("wall", "cpu"))
        wall_ratio, cpu_ratio = (statistics.median(ratios[contender][k]) for k in ("wall", "cpu"))
        print(f"| {label} | {wall:.1f} | {cpu:.1f} | {wall_ratio:.3f}x | {cpu_ratio:.3f}x |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
