"""What checkpointing adds to nvrx_core.collectives: a side group for background threads.

Every collective of the checkpointers goes through nvrx_core.collectives (the device from the
group's backend, integers or JSON only, tensors let go of only after the backend has). Their
background workers agree on each save while the training thread runs its own collectives, and
two threads must never interleave collectives on one group: side_group gives the workers a
group of their own.
"""

import datetime
from typing import Any, Optional

import torch.distributed as dist

from nvrx_core.collectives import SINGLE_PROCESS, resolve_group


def side_group(group: Any, timeout: Optional[datetime.timedelta] = None) -> Any:
    """A gloo group with the same ranks as `group` (None: the default group), for a background
    thread's collectives. SINGLE_PROCESS (or None without torch.distributed) stays
    SINGLE_PROCESS: nobody to agree with. Collective for the members only."""
    group = resolve_group(group)
    if group is SINGLE_PROCESS:
        return SINGLE_PROCESS
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo",
                          timeout=timeout, use_local_synchronization=True)
