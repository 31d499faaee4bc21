"""Where DeepSpeed's flat buffers keep each parameter (_ds_layout.py): every element of every
parameter is in exactly one extent, in order, inside its rank's buffer, for any shapes and
world size ([Note: reading DeepSpeed's layouts]). The fixtures' checkpoints check the same
arithmetic against DeepSpeed's real files (test_checkpoint_deepspeed.py)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zengine._checkpoint._ds_layout import Param, layout_stage3, layout_stage12

sizes = st.lists(st.integers(1, 40), min_size=1, max_size=6)
# a loaded 2-core machine can make a draw slow; the check is of the layouts, not of the draws
calm = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _covers(param: Param, buffer: int) -> None:
    at = 0
    for extent in param.extents:
        assert extent.param_offset == at
        assert extent.length > 0
        assert extent.offset >= 0
        assert extent.offset + extent.length <= buffer
        at += extent.length
    assert at == param.numel


@calm
@given(sizes, st.integers(1, 5))
def test_stage3_every_element_once(numels: list[int], world: int) -> None:
    shapes = [{f"p{i}": (n,) for i, n in enumerate(numels)}]
    params = layout_stage3(shapes, [0], world)
    buffer = sum(math.ceil(n / world) for n in numels)  # a rank's buffer
    for param in params.values():
        _covers(param, buffer)
        assert [e.rank for e in param.extents] == list(range(len(param.extents)))


@calm
@given(sizes, st.integers(1, 5))
def test_stage12_every_element_once(numels: list[int], world: int) -> None:
    shapes = [{f"p{i}": (n,) for i, n in enumerate(numels)}]
    align = 2 * world  # DeepSpeed pads a group to this multiple, then cuts it in `world`
    partition = math.ceil(sum(numels) / align) * align // world
    params = layout_stage12(shapes, [None], [partition])
    for param in params.values():
        _covers(param, partition)
        assert all(e.rank < world for e in param.extents)
    ends = [(e.rank * partition + e.offset) for p in params.values() for e in p.extents]
    assert ends == sorted(ends)  # the group's parameters in order along the flat buffer
