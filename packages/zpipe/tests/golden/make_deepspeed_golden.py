"""Regenerate deepspeed_steps.json.gz from DeepSpeed's own schedule.py.

    pip download --no-deps --no-binary :all: deepspeed==0.19.8 -d /tmp/ds
    tar xzf /tmp/ds/deepspeed-0.19.8.tar.gz -C /tmp/ds
    python make_deepspeed_golden.py /tmp/ds/deepspeed-0.19.8/deepspeed/runtime/pipe/schedule.py

DeepSpeed's module is run as published; only its one import (`call_to_str`) is given here, since
importing the deepspeed package would need torch.
"""

import gzip
import json
import sys
import types
from pathlib import Path
from typing import Any

GRID_STAGES = range(1, 9)
GRID_MICRO_BATCHES = range(1, 13)


def load_schedule_module(path: str) -> Any:
    utils = types.ModuleType("deepspeed_utils_stub")

    def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
        parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        return f"{base}({', '.join(parts)})"

    utils.call_to_str = call_to_str  # type: ignore[attr-defined]
    source = Path(path).read_text().replace("from ..utils import call_to_str", "")
    module = types.ModuleType("deepspeed_schedule")
    module.__dict__["call_to_str"] = call_to_str
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def main() -> None:
    schedule = load_schedule_module(sys.argv[1])
    golden: dict[str, Any] = {}
    for cls_name in ("InferenceSchedule", "TrainSchedule", "DataParallelSchedule"):
        cls = getattr(schedule, cls_name)
        for stages in GRID_STAGES if cls_name != "DataParallelSchedule" else [1]:
            for micro_batches in GRID_MICRO_BATCHES:
                for stage_id in range(stages):
                    sched = cls(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
                    steps = [[repr(cmd) for cmd in step] for step in sched]
                    key = f"{cls_name}/{micro_batches}/{stages}/{stage_id}"
                    golden[key] = {"buffers": sched.num_pipe_buffers(), "steps": steps}
    out = Path(__file__).with_name("deepspeed_steps.json.gz")
    out.write_bytes(gzip.compress(json.dumps(golden, sort_keys=True).encode(), mtime=0))
    print(f"wrote {len(golden)} schedules to {out}")


if __name__ == "__main__":
    main()
