"""In-process restart: re-run a distributed training function inside the same processes after a fault.

    from nvrx_core.inprocess import Wrapper, RestartState

    @Wrapper(soft_timeout=60, hard_timeout=90)
    def train(state: RestartState):
        state.init_process_group("nccl")
        ...

See docs/inprocess.md.
"""

from nvrx_core.inprocess.config import InProcessConfig
from nvrx_core.inprocess.errors import BarrierTimeout, InProcessGaveUp, RankExcluded, RestartError, RestartRequested
from nvrx_core.inprocess.rank_assignment import (ActivateReserves, Assignment, DivisibleBy, FillGapsFromTop,
                                                 KeepWholeNodes, LimitWorldSize, ShiftRanks, compose)
from nvrx_core.inprocess.records import Cause, InterruptionRecord
from nvrx_core.inprocess.state import RestartState
from nvrx_core.inprocess.wrapper import Wrapper

__all__ = [
    "ActivateReserves", "Assignment", "BarrierTimeout", "Cause", "DivisibleBy", "FillGapsFromTop", "InProcessConfig",
    "InProcessGaveUp", "InterruptionRecord", "KeepWholeNodes", "LimitWorldSize", "RankExcluded", "RestartError",
    "RestartRequested", "RestartState", "ShiftRanks", "Wrapper", "compose",
]
