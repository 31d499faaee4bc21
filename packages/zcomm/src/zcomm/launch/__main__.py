"""``python -m zcomm.launch``: the launcher (DeepSpeed's ``deepspeed`` command line)."""

import sys

from zcomm.launch._runner import main

sys.exit(main(prog="python -m zcomm.launch"))
