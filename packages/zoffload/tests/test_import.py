import importlib.metadata

import zoffload


def test_version_matches_metadata() -> None:
    assert zoffload.__version__ == importlib.metadata.version("zoffload")
