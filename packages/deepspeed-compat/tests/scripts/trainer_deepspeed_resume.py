"""The Trainer on zstack resumes a run DeepSpeed saved: run under torchrun by
test_trainer_deepspeed_resume.py.

``trainer_deepspeed_resume.py RUN_DIR``: the fixture's run (deepspeed_trainer_checkpoint/make.py,
whose Trainer set-up is used unchanged) trained here from its starting weights, and resumed
here from the checkpoint DeepSpeed saved; rank 0 writes both runs' losses.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "deepspeed_trainer_checkpoint"))
import make as fixture  # noqa: E402

from _helpers import write_result  # noqa: E402

RUN_DIR = Path(sys.argv[1])
saved = RUN_DIR / "deepspeed-checkpoint"
if int(__import__("os").environ.get("RANK", "0")) == 0:
    shutil.copytree(fixture.HERE / f"checkpoint-{fixture.SAVE_AT}", saved)
straight = fixture.train(RUN_DIR / "straight", fixture.HERE / "model")
resumed = fixture.train(RUN_DIR / "resumed", fixture.HERE / "model", resume=saved)
write_result({"straight": straight, "resumed": resumed})
