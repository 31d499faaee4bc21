"""Step lists and buffer counts equal DeepSpeed 0.19.8's, for every stage of a grid of shapes.

golden/deepspeed_steps.json.gz was written by DeepSpeed's own schedule.py
(golden/make_deepspeed_golden.py says how to regenerate it).
"""

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

import zpipe.schedule as schedule

GOLDEN: dict[str, Any] = json.loads(
    gzip.decompress((Path(__file__).parent / "golden" / "deepspeed_steps.json.gz").read_bytes())
)


def test_golden_covers_the_grid():
    classes = {key.split("/")[0] for key in GOLDEN}
    assert classes == {"InferenceSchedule", "TrainSchedule", "DataParallelSchedule"}
    assert len(GOLDEN) == 876


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_same_steps_as_deepspeed(key: str):
    cls_name, micro_batches, stages, stage_id = key.split("/")
    sched = getattr(schedule, cls_name)(
        micro_batches=int(micro_batches), stages=int(stages), stage_id=int(stage_id)
    )
    steps = [[repr(cmd) for cmd in step] for step in sched]
    assert steps == GOLDEN[key]["steps"]
    assert sched.num_pipe_buffers() == GOLDEN[key]["buffers"]
