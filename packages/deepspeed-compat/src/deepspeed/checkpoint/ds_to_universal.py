"""``deepspeed.checkpoint.ds_to_universal``: a checkpoint as DeepSpeed's universal checkpoint.

``python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/global_step5
--output_folder CKPT/global_step5_universal`` (or ``main(args)`` with those attributes, as
DeepSpeed's tests call it) writes zstack's checkpoint `input_folder` as the universal folder
`output_folder` and ``latest_universal`` beside it, through zengine's exporter
(``zengine.utils.universal``): DeepSpeed loads it with ``"checkpoint": {"load_universal":
true}`` at any world size and stage. DeepSpeed's worker counts and temporary folders do not
apply (the export streams a parameter at a time). A folder DeepSpeed saved needs no converting
for zstack, which loads it as it is; it is refused here, with that said.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zengine.utils.universal import export_universal

__all__ = ["main", "parse_arguments"]


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's arguments (the ones zstack has no use for are accepted and ignored)."""
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed.checkpoint.ds_to_universal", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--input_folder", required=True, help="the checkpoint (one tag)")
    parser.add_argument("--output_folder", required=True, help="the universal folder to write")
    parser.add_argument("--num_extract_workers", type=int, default=4, help="(ignored)")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="(ignored)")
    parser.add_argument("--keep_temp_folder", action="store_true", help="(ignored)")
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="(ignored)")
    parser.add_argument("--inject_missing_state", action="store_true", help="(ignored)")
    return parser.parse_args(argv)


def main(args: Any) -> None:
    """Convert ``args.input_folder`` into ``args.output_folder`` (see the module doc)."""
    input_folder = Path(args.input_folder)
    if any(input_folder.glob("*_model_states.pt")):
        raise SystemExit(
            f"{input_folder} is DeepSpeed's own checkpoint: zstack loads it as it is "
            "(engine.load_checkpoint), and DeepSpeed's own ds_to_universal converts it"
        )
    out = export_universal(input_folder, args.output_folder, latest=True)
    print(f"wrote {out} (DeepSpeed's universal checkpoint) and {out.parent / 'latest_universal'}")


if __name__ == "__main__":
    main(parse_arguments(sys.argv[1:]))
