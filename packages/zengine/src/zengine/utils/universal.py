"""DeepSpeed's universal checkpoints, both ways: the way back from zstack to DeepSpeed.

``export_universal(checkpoint, out_dir)`` writes a zstack checkpoint (any world size, ZeRO
stage, precision) as DeepSpeed's universal checkpoint (what its ``ds_to_universal`` writes),
which DeepSpeed loads at any world size and stage with ``"checkpoint": {"load_universal":
true}``; ``engine.save_checkpoint(..., universal=True)`` and ``zengine consolidate CKPT OUT
--universal`` do the same. The other way needs nothing: ``engine.load_checkpoint`` reads
DeepSpeed's universal folders (and its own checkpoints) as they are.
"""

from __future__ import annotations

from zengine._checkpoint import export_universal

__all__ = ["export_universal"]
