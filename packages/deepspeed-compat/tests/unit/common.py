"""DeepSpeed's ``unit.common``: the distributed test harness is zcomm's."""

from zcomm.testing import (
    DistributedFixture,
    DistributedTest,
    get_master_port,
    preferred_dtype,
)

__all__ = ["DistributedFixture", "DistributedTest", "get_master_port", "preferred_dtype"]
