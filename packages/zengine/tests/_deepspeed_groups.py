"""What a test running the real DeepSpeed in the pooled ranks does first.

DeepSpeed keeps its process groups in module globals (``deepspeed.utils.groups``). The pooled
ranks of `zcomm.testing.DistributedTest` outlive a test's process group, so the next test that
starts DeepSpeed would find the last test's destroyed groups there and fail in
``deepspeed.initialize`` ("Group ... is not registered"). DeepSpeed forgets them itself only in
its own ``destroy_process_group``, which the pool does not call.
"""

from __future__ import annotations


def forget_deepspeed_groups() -> None:
    """Drop the groups an earlier test left in DeepSpeed's globals, as DeepSpeed's
    ``deepspeed.comm.destroy_process_group`` does after tearing the world down."""
    from deepspeed.utils import groups

    groups._release_process_group_references()
