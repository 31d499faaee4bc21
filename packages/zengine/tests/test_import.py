import importlib.metadata

import zengine


def test_version_matches_metadata() -> None:
    assert zengine.__version__ == importlib.metadata.version("zengine")


def test_import_leaves_checkpoint_machinery_alone() -> None:
    """torch.distributed.checkpoint costs about a second and 50 MiB to import: only a save or
    a load brings it in, not ``import zengine`` (a fresh interpreter to see it)."""
    import subprocess
    import sys

    code = "import sys, zengine; print('torch.distributed.checkpoint' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
