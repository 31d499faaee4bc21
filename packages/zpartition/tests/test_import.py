import importlib.metadata

import zpartition


def test_version_matches_metadata() -> None:
    assert zpartition.__version__ == importlib.metadata.version("zpartition")
