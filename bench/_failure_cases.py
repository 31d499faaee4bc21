"""One rank of one failure case of `bench_failures.py`, written against DeepSpeed's API so that
the same code runs on zstack (the compatibility ``deepspeed`` first on the path) and on
DeepSpeed itself.

Usage (the driver sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun would):
``python _failure_cases.py <case> <work folder>``. Each rank prints one ``RESULT`` line: the
clock when the ranks diverged (``diverged``), when the case ended (``ended``), and how it ended:
``error`` (the exception's type and first line), ``ok`` (it returned), and ``payload`` when a
payload planted in a file ran. The driver reads what a rank that never printed did (killed,
hung) from its exit.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import ds_fixture

fx: Any = ds_fixture()

# zstack's compatibility package or DeepSpeed, whichever the driver put on the path; imported by
# main(), so that the driver can read CASES without either
deepspeed: Any = None
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
DIVERGED: list[float] = []


class Payload:
    """What a shared checkpoint could hold: unpickling it creates the file `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


def diverge() -> None:
    """From here on the ranks do different things (or read a damaged file)."""
    DIVERGED.append(time.time())


def config(**zero: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = fx.config("stage3_fp32_ws2", WORLD)
    cfg["zero_optimization"].update(zero)
    return cfg


def engine(cfg: dict[str, Any] | None = None) -> Any:
    m = fx.model()
    built, *_ = deepspeed.initialize(
        model=m, model_parameters=fx.param_groups(m), config=cfg or config()
    )
    return built


def batch() -> torch.Tensor:
    out: torch.Tensor = fx.local(fx.batches(1)[0], RANK, WORLD)
    return out


def train(eng: Any, steps: int = 1) -> None:
    for _ in range(steps):
        eng.backward(eng(batch()))
        eng.step()


# -- the cases ------------------------------------------------------------------------------------


def client_state_payload(work: Path) -> None:
    """save_checkpoint with an object in client_state, then load_checkpoint in a new engine."""
    eng = engine()
    train(eng)
    diverge()
    eng.save_checkpoint(str(work / "ckpt"), client_state={"sampler": Payload(str(work / "ran"))})
    engine().load_checkpoint(str(work / "ckpt"))


def planted_model_states(work: Path) -> None:
    """load_checkpoint of a DeepSpeed checkpoint whose model-states file holds a payload (the
    driver planted it in a copy of a fixture that DeepSpeed 0.19.8 wrote)."""
    eng = engine()
    diverge()
    eng.load_checkpoint(str(work / "planted"))


def planted_zero_to_fp32(work: Path) -> None:
    """The offline tool on the same planted checkpoint (rank 0 only)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    diverge()
    if RANK == 0:
        get_fp32_state_dict_from_zero_checkpoint(str(work / "planted"))


def flipped_byte_zero_to_fp32(work: Path) -> None:
    """One byte flipped in the middle of the largest file of a checkpoint the engine saved, then
    the offline tool (rank 0): an error, or the changed model without a word."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    eng = engine()
    train(eng)
    eng.save_checkpoint(str(work / "ckpt"), tag="t")
    torch.distributed.barrier()
    diverge()
    if RANK == 0:
        files = [p for p in (work / "ckpt" / "t").rglob("*") if p.is_file()]
        largest = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(largest.read_bytes())
        data[len(data) * 3 // 5] ^= 0x10
        largest.write_bytes(bytes(data))
        get_fp32_state_dict_from_zero_checkpoint(str(work / "ckpt"), tag="t")


def step_while_other_forwards(work: Path) -> None:
    """Rank 0 calls step() while rank 1 runs another forward."""
    eng = engine()
    train(eng)
    loss = eng(batch())
    eng.backward(loss)
    diverge()
    if RANK == 1:
        eng(batch())
    eng.step()


def skipped_backward(work: Path) -> None:
    """Rank 1 skips a backward and goes on to step()."""
    eng = engine()
    train(eng)
    loss = eng(batch())
    diverge()
    if RANK == 0:
        eng.backward(loss)
    eng.step()
    train(eng)


def frozen_rank(work: Path) -> None:
    """Rank 1 stops (SIGSTOP) after a step; rank 0 trains on."""
    eng = engine()
    train(eng)
    diverge()
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    train(eng, 2)


def _per_rank(key: str, values: tuple[Any, Any]) -> None:
    """`key` set to one value on rank 0 and another on rank 1, then a step."""
    diverge()
    train(engine(config(**{key: values[RANK % 2]})))


def mics_shard_size_differs(work: Path) -> None:
    """mics_shard_size 1 on rank 0, 2 on rank 1."""
    _per_rank("mics_shard_size", (1, 2))


def hpz_partition_size_differs(work: Path) -> None:
    """zero_hpz_partition_size 1 on rank 0, 2 on rank 1."""
    _per_rank("zero_hpz_partition_size", (1, 2))


def persistence_threshold_differs(work: Path) -> None:
    """stage3_param_persistence_threshold 0 on rank 0, 1e9 on rank 1."""
    _per_rank("stage3_param_persistence_threshold", (0, int(1e9)))


def gathered_edit_without_modifier(work: Path) -> None:
    """An in-place change inside GatheredParameters without modifier_rank."""
    eng = engine()
    weight = eng.module.up.weight
    diverge()
    with deepspeed.zero.GatheredParameters([weight]):
        weight.data.add_(1.0)


def string_lr(work: Path) -> None:
    """ "lr": "1e-2" in the optimizer's params, then a step."""
    cfg = config()
    cfg["optimizer"]["params"]["lr"] = "1e-2"
    cfg.pop("scheduler")
    diverge()
    train(engine(cfg))


def crashed_instead_of_saving(work: Path) -> None:
    """Rank 1 exits where it should save; rank 0 saves."""
    eng = engine()
    train(eng)
    diverge()
    if RANK == 1:
        os._exit(3)
    eng.save_checkpoint(str(work / "ckpt"))


def _nvme_config(path: Path) -> dict[str, Any]:
    return config(
        offload_optimizer={"device": "nvme", "nvme_path": str(path)},
        offload_param={"device": "nvme", "nvme_path": str(path)},
    )


def nvme_full_disk(work: Path) -> None:
    """ZeRO-Infinity with rank 1's NVMe folder on a 4 KiB tmpfs (the driver mounts it)."""
    path = work / ("small" if RANK == 1 else "big")
    diverge()
    train(engine(_nvme_config(path)), 2)


def nvme_read_only(work: Path) -> None:
    """ZeRO-Infinity with the NVMe folder on a read-only mount (the driver mounts it)."""
    diverge()
    train(engine(_nvme_config(work / "readonly")), 1)


CASES: dict[str, Callable[[Path], None]] = {
    f.__name__: f
    for f in (
        client_state_payload,
        planted_model_states,
        planted_zero_to_fp32,
        flipped_byte_zero_to_fp32,
        step_while_other_forwards,
        skipped_backward,
        frozen_rank,
        mics_shard_size_differs,
        hpz_partition_size_differs,
        persistence_threshold_differs,
        gathered_edit_without_modifier,
        string_lr,
        crashed_instead_of_saving,
        nvme_full_disk,
        nvme_read_only,
    )
}


def main() -> None:
    global deepspeed
    import deepspeed as chosen

    deepspeed = chosen
    case, work = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": RANK}
    try:
        CASES[case](work)
        result["outcome"] = "ok"
    except BaseException as e:  # the point: whatever the engine raised, named as it was
        first = " / ".join(line.strip() for line in str(e).strip().splitlines()[:2])
        result |= {"outcome": "error", "error": f"{type(e).__name__}: {first}"[:300]}
    result["ended"] = time.time()
    result["diverged"] = DIVERGED[0] if DIVERGED else None
    if (work / "ran").exists():
        result["outcome"] = "payload"
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # no teardown: a peer may be gone or stopped


if __name__ == "__main__":
    main()
