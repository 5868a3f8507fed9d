"""A process's place in a distributed job, as its launcher's environment states it.

torchrun, ft_launcher and the launchers built on them give every worker RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE and TORCHELASTIC_RESTART_COUNT. Every part of nvrx reads them
here, under one rule:

- unset: the process runs alone, as `python train.py` does: rank 0, local rank 0, world size 1,
  local world size 1, restart count 0. A caller that must tell "not a launcher's worker" apart
  from "rank 0" (the launcher's own event log records rank None) asks with `optional=True` and
  gets None instead; nothing else differs.
- set: the value must be an integer (what `int()` takes, as torch reads it), ranks and the
  restart count >= 0, sizes >= 1, and a rank below its world size when both are set.
  Anything else raises ConfigError (a ValueError) naming the variable and its value.

Why refuse instead of falling back to the default: a rank silently read as 0 makes two
processes both rank 0, and what follows (two writers of rank 0's checkpoint, a monitor that
registers one rank twice, a fault injected into the wrong rank) is far from the cause.

Every function takes the mapping to read (default: os.environ), so a caller holding another
environment, or a test, passes its own. Torch-free: nvrx_core.events, which `nvrx report`
imports without torch, reads the rank here.
"""

import os
from typing import Mapping, Optional

from nvrx_core.config import ConfigError

Env = Optional[Mapping[str, str]]


def _read(env: Env, name: str, *, unset: int, least: int, optional: bool) -> Optional[int]:
    """The integer in `name`, `unset` (None when optional) when absent; ConfigError when invalid."""
    raw = (os.environ if env is None else env).get(name)
    if raw is None:
        return None if optional else unset
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"environment variable {name}={raw!r}: must be an integer "
                          f"(unset means a single process)") from None
    if value < least:
        raise ConfigError(f"environment variable {name}={raw!r}: must be >= {least}")
    return value


def _rank_below(env: Env, rank_name: str, size_name: str, optional: bool) -> Optional[int]:
    """The rank in `rank_name`, checked against the size in `size_name` when that is set too."""
    value = _read(env, rank_name, unset=0, least=0, optional=optional)
    size = _read(env, size_name, unset=1, least=1, optional=True)
    if value is not None and size is not None and value >= size:
        raise ConfigError(f"environment variable {rank_name}={value}: must be below {size_name}={size}")
    return value


def rank(env: Env = None, *, optional: bool = False) -> Optional[int]:
    """RANK: this process's global rank (0 when unset)."""
    return _rank_below(env, "RANK", "WORLD_SIZE", optional)


def local_rank(env: Env = None, *, optional: bool = False) -> Optional[int]:
    """LOCAL_RANK: this process's rank on its node (0 when unset)."""
    return _rank_below(env, "LOCAL_RANK", "LOCAL_WORLD_SIZE", optional)


def world_size(env: Env = None, *, optional: bool = False) -> Optional[int]:
    """WORLD_SIZE: the number of processes in the job (1 when unset)."""
    return _read(env, "WORLD_SIZE", unset=1, least=1, optional=optional)


def local_world_size(env: Env = None, *, optional: bool = False) -> Optional[int]:
    """LOCAL_WORLD_SIZE: the number of the job's processes on this node (1 when unset)."""
    return _read(env, "LOCAL_WORLD_SIZE", unset=1, least=1, optional=optional)


def restart_count(env: Env = None, *, optional: bool = False) -> Optional[int]:
    """TORCHELASTIC_RESTART_COUNT: the launcher's restart cycle this process belongs to (0 when unset)."""
    return _read(env, "TORCHELASTIC_RESTART_COUNT", unset=0, least=0, optional=optional)
