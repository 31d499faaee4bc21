import importlib.metadata

import zcomm


def test_version_matches_metadata() -> None:
    assert zcomm.__version__ == importlib.metadata.version("zcomm")
