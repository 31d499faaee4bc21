"""Every schedule and instruction, as `deepspeed.runtime.pipe.schedule` names them, and more.

`import zpipe.schedule as schedule` stands in for `import deepspeed.runtime.pipe.schedule as
schedule`.
"""

from zpipe._base import PipeSchedule
from zpipe._deepspeed import DataParallelSchedule, InferenceSchedule, TrainSchedule
from zpipe._gpipe import GPipeSchedule
from zpipe._instructions import (
    BackwardInputPass,
    BackwardPass,
    BackwardWeightPass,
    BufferOpInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from zpipe._interleaved import Interleaved1F1BSchedule
from zpipe._zero_bubble import ZeroBubbleH1Schedule

__all__ = [
    "BackwardInputPass",
    "BackwardPass",
    "BackwardWeightPass",
    "BufferOpInstruction",
    "DataParallelSchedule",
    "ForwardPass",
    "GPipeSchedule",
    "InferenceSchedule",
    "Interleaved1F1BSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
    "ZeroBubbleH1Schedule",
]
