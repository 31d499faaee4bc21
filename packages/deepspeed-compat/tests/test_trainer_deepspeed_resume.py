"""A Trainer run DeepSpeed saved, resumed on zstack: ``resume_from_checkpoint`` of a
``checkpoint-N`` folder the real DeepSpeed 0.19.8 wrote (deepspeed_trainer_checkpoint/, with
the script that made it and DeepSpeed's own losses), under torchrun on 2 ranks.

The resumed steps must match DeepSpeed's resumed steps as closely as the two engines match
each other from the same start (`own`, measured here on the same steps): within
``2 * own + 1e-5``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _helpers import torchrun

FIXTURE = Path(__file__).parent / "deepspeed_trainer_checkpoint"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return torchrun("trainer_deepspeed_resume.py", str(tmp_path_factory.mktemp("resume")))


def test_resumed_steps_match_deepspeed(runs: dict[str, Any]) -> None:
    recorded = json.loads((FIXTURE / "losses.json").read_text())
    saved_at = 2
    own = max(
        abs(a - b)
        for a, b in zip(runs["straight"][saved_at:], recorded["straight"][saved_at:], strict=True)
    )
    ours, theirs = runs["resumed"][saved_at:], recorded["resumed"][saved_at:]
    assert len(ours) == len(theirs) == 2
    gap = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    assert gap <= 2 * own + 1e-5, f"{gap} from DeepSpeed's resumed losses (engines apart: {own})"
    # the steps before the save come from the checkpoint's trainer_state.json, as logged
    assert runs["resumed"][:saved_at] == recorded["resumed"][:saved_at]
