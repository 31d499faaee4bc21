import importlib.metadata

import zengine


def test_version_matches_metadata() -> None:
    assert zengine.__version__ == importlib.metadata.version("zengine")
