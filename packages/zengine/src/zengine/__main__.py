"""``python -m zengine``: the ``zengine`` command."""

import sys

from zengine._cli import main

sys.exit(main())
