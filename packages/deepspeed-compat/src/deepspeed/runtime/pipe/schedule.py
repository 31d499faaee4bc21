"""``deepspeed.runtime.pipe.schedule``: zpipe's schedules and instructions, the same classes."""

from zpipe.schedule import *  # noqa: F403 - the whole module, as DeepSpeed's
from zpipe.schedule import __all__ as __all__
