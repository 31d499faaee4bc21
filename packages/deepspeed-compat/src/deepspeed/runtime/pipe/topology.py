"""``deepspeed.runtime.pipe.topology``: zcomm's process topologies and pipeline grid."""

from zcomm.topology import *  # noqa: F403 - the whole module, as DeepSpeed's
from zcomm.topology import __all__ as __all__
