"""zpipe stands alone: no dependencies, no torch, typed."""

import importlib.metadata
import importlib.resources
import subprocess
import sys

import zpipe


def test_version_matches_metadata():
    assert zpipe.__version__ == importlib.metadata.version("zpipe")


def test_no_dependencies():
    assert importlib.metadata.requires("zpipe") in (None, [])


def test_import_pulls_no_torch():
    code = "import sys, zpipe, zpipe.schedule; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_typed():
    assert importlib.resources.files("zpipe").joinpath("py.typed").is_file()


def test_public_names():
    for name in zpipe.__all__:
        assert getattr(zpipe, name) is not None, name
