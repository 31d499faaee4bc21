"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: Ulysses sequence parallelism, which
zstack does not have. Accelerate imports these names only when a sequence-parallel size above 1
is asked for; they raise there, naming the feature."""

from deepspeed._refused import SEQUENCE_PARALLEL, refused

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]

UlyssesSPAttentionHF = refused(
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF", *SEQUENCE_PARALLEL
)
UlyssesSPDataLoaderAdapter = refused(
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter",
    *SEQUENCE_PARALLEL,
)
