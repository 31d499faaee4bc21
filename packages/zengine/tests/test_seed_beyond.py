"""Seed cases DeepSpeed itself skips, run here: zengine passes them.

DeepSpeed's test_zero_context_return.py marks ``test_ext_param_returnobj`` WIP (a module that
returns an object holding another module's parameter). The seed file stays as it came, its
skip included; this runs the same method body.
"""

from __future__ import annotations

from zcomm.testing import DistributedTest

from . import test_seed_zero_context_return as seed  # the module: pytest collects no class twice


class TestBeyondDeepSpeed(DistributedTest):
    world_size = 1

    def test_ext_param_returnobj(self) -> None:
        # the seed's method, without its WIP mark (marks do not change the function)
        seed.TestReturnParam.test_ext_param_returnobj(seed.TestReturnParam())
