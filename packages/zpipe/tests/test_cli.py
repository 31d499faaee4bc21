"""The `zpipe` command."""

import shutil
import subprocess
import sys

import pytest

from zpipe.__main__ import main


def test_prints_timeline_bubble_and_peaks(capsys):
    assert main(["zb-h1", "--stages=4", "--micro-batches=8", "--backward=1", "--weight=1"]) == 0
    out = capsys.readouterr().out
    assert "ZeroBubbleH1Schedule: 4 stages, 8 micro-batches" in out
    assert "validated: no deadlock" in out
    assert "stage 3 |" in out
    assert "makespan 27, bubble 11.11%" in out
    assert "peak activations per stage (in micro-batches): 4 4 4 4" in out


def test_interleaved_with_chunks_and_steps(capsys):
    assert main(["interleaved", "-p", "2", "-m", "2", "-v", "2", "--steps"]) == 0
    out = capsys.readouterr().out
    assert "stage 1 (" in out
    assert "RecvActivation(buffer_id=" in out
    assert "2 chunks per stage" in out


def test_per_stage_costs(capsys):
    assert main(["1f1b", "-p", "2", "-m", "8", "--forward", "1,2", "--backward", "2,4"]) == 0
    assert "makespan 51" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nope"], "unknown schedule 'nope'"),
        (["1f1b", "--stages=0"], "stages must be at least 1"),
        (["1f1b", "--forward=x"], "expected a number or numbers with commas"),
        (["1f1b", "-p", "2", "--forward=1,2,3"], "forward has 3 costs, one per stage needs 2"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_and_console_script():
    done = subprocess.run(
        [sys.executable, "-m", "zpipe", "gpipe", "-p", "2", "-m", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "GPipeSchedule: 2 stages" in done.stdout
    script = shutil.which("zpipe")
    if script is None:
        pytest.skip("the console script is installed only with the package (nox -s tests)")
    done = subprocess.run([script, "1f1b"], capture_output=True, text=True, check=True)
    assert "TrainSchedule: 4 stages, 8 micro-batches" in done.stdout
