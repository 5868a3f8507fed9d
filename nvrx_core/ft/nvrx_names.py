"""nvidia-resiliency-ext's rank-side fault-tolerance names, as views of nvrx_core.ft's mechanisms.

Code written for nvidia-resiliency-ext (NVRx) reads a client's `cfg`, `hb_timeouts` and
`section_timeouts`, learns timeouts with `calculate_and_set_hb_timeouts` and
`calculate_and_set_section_timeouts`, and catches `RankMonitorClientError`. RankMonitorClient
takes those from NVRxClientNames below: each is a view of the client's one state (what the
monitor enforces, what was learned) or a call into its one `calculate_and_set_timeouts`, so
the two vocabularies can be mixed in one job and never disagree. What still differs, and
why, is in docs/migrating.md; the behaviours a user would notice are also logged where they
happen (a null timeout that learning leaves off, a workload request ft_launcher ignores).
"""

import dataclasses
import enum
import logging
from typing import Any, Collection, Dict, Mapping, Optional, Set

from nvrx_core.config import ConfigError, check
from nvrx_core.ft.protocol import encode

logger = logging.getLogger("nvrx.ft.client")

NVRX_STATE_KEY = "current_timeouts"
"""The key of nvidia-resiliency-ext's client state_dict; load_state_dict reads that form too."""
HEARTBEAT_NAMES = ("initial_heartbeat", "heartbeat")
OUT_OF_SECTION = "out_of_section"


class RankMonitorClientError(Exception):
    """A rank's fault-tolerance call could not do what it was asked (NVRx's exception name)."""


class MonitorUnreachable(RankMonitorClientError, ConnectionError):
    """The node monitor could not be reached or would not register the rank. Both bases: code
    written for NVRx catches RankMonitorClientError, code written for nvrx-suite ConnectionError."""


class WorkloadControlUnavailable(RankMonitorClientError, RuntimeError):
    """A workload control request that cannot reach ft_launcher (NVRx raises RuntimeError when
    its launcher cannot be reached: a caller may catch either)."""


@dataclasses.dataclass
class HeartbeatTimeouts:
    """The heartbeat timeouts a rank is held to, in NVRx's shape (None: not enforced)."""

    initial: Optional[float] = None
    subsequent: Optional[float] = None
    were_calculated: Optional[bool] = None

    @property
    def are_valid(self) -> bool:
        return self.initial is not None and self.subsequent is not None


@dataclasses.dataclass
class SectionTimeouts:
    """The section timeouts a rank is held to, in NVRx's shape (None: not enforced)."""

    section: Mapping[str, Optional[float]] = dataclasses.field(default_factory=dict)
    out_of_section: Optional[float] = None
    calculated_sections: Set[str] = dataclasses.field(default_factory=set)
    is_out_of_section_calculated: bool = False

    @property
    def were_calculated(self) -> bool:
        return set(self.calculated_sections) == set(self.section) and self.is_out_of_section_calculated

    @property
    def are_valid(self) -> bool:
        return all(v is not None for v in self.section.values()) and self.out_of_section is not None


class WorkloadAction(enum.Enum):
    """What a rank may ask of the launcher after an exception (NVRx's names and values)."""

    Continue = 0
    ExcludeThisNode = 1
    ShutdownWorkload = 2


class WorkloadControlRequest:
    def __init__(self, action: WorkloadAction, description: str = "<not set>"):
        check(isinstance(action, WorkloadAction), "action", action, "must be a WorkloadAction")
        self.action = action
        self.description = description

    def __repr__(self) -> str:
        return f"WorkloadControlRequest(action={self.action}, description={self.description!r})"


class NVRxClientNames:
    """NVRx's client attributes and methods; mixed into RankMonitorClient, which provides
    `is_active`, `cfg` (the monitor's FTConfig once registered), `effective_timeouts`,
    `calculated` and `calculate_and_set_timeouts(skip_if_not_ready, exclude, require)`."""

    @property
    def is_initialized(self) -> bool:
        return self.is_active

    @property
    def hb_timeouts(self) -> Optional[HeartbeatTimeouts]:
        """None until the rank registered (as in NVRx); then what the monitor enforces."""
        enforced = self.effective_timeouts
        if enforced is None:
            return None
        learned = self.calculated
        return HeartbeatTimeouts(enforced.initial_heartbeat, enforced.heartbeat,
                                 learned.initial_heartbeat is not None or learned.heartbeat is not None)

    @property
    def section_timeouts(self) -> Optional[SectionTimeouts]:
        enforced = self.effective_timeouts
        if enforced is None:
            return None
        learned = self.calculated
        return SectionTimeouts(dict(enforced.sections), enforced.out_of_section,
                               {name for name, v in learned.sections.items() if v is not None},
                               learned.out_of_section is not None)

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """Collective: learn the two heartbeat timeouts (safety_factor x the longest seen on
        any rank). Not enough data (no rank saw a first heartbeat and an interval past the
        warm-up): False if skip_if_not_ready, else RankMonitorClientError. Outside ft_launcher
        every call is a no-op, so this returns False."""
        if not self.is_active:
            return False
        self._warn_left_off(HEARTBEAT_NAMES)
        sections = tuple(self.cfg.rank_section_timeouts)
        return self.calculate_and_set_timeouts(skip_if_not_ready, exclude=(*sections, OUT_OF_SECTION),
                                               require=HEARTBEAT_NAMES)

    def calculate_and_set_section_timeouts(self, selected_sections: Optional[Collection[str]] = None,
                                           calc_out_of_section: bool = True, skip_if_not_ready: bool = False) -> bool:
        """Collective: learn the timeouts of `selected_sections` (None: every configured one)
        and, with calc_out_of_section, the out-of-section timeout; the others keep theirs."""
        if not self.is_active:
            return False
        configured = tuple(self.cfg.rank_section_timeouts)
        if selected_sections is None:
            selected = configured
        else:
            check(not isinstance(selected_sections, str) and isinstance(selected_sections, Collection),
                  "selected_sections", selected_sections, "must be a collection of section names or None")
            selected = tuple(selected_sections)
            unknown = sorted(set(selected) - set(configured))
            check(not unknown, "selected_sections", unknown,
                  f"not in rank_section_timeouts (configured: {sorted(configured)})")
        asked = (*selected, OUT_OF_SECTION) if calc_out_of_section else selected
        self._warn_left_off(asked)
        left = tuple(name for name in configured if name not in selected)
        exclude = (*HEARTBEAT_NAMES, *left) if calc_out_of_section else (*HEARTBEAT_NAMES, *left, OUT_OF_SECTION)
        return self.calculate_and_set_timeouts(skip_if_not_ready, exclude=exclude, require=asked)

    def send_workload_control_request(self, req: WorkloadControlRequest) -> None:
        """Ask ft_launcher what to do at the next failure instead of restarting: end the job
        on every node (ShutdownWorkload, exit 24) or take this node out (ExcludeThisNode, exit
        25). `Continue` is what it does anyway. The node monitor passes the request on when the
        launcher asks how the failed cycle went (ft/agent.py)."""
        check(isinstance(req, WorkloadControlRequest), "req", req, "must be a WorkloadControlRequest")
        if req.action is WorkloadAction.Continue:
            return
        link = self._link
        if link is None:
            raise WorkloadControlUnavailable(f"{req!r}: this rank is not connected to ft_launcher's node monitor "
                                             "(init_workload_monitoring first, under ft_launcher)")
        with self._lock:
            link.send(encode("wc", action=req.action.name, reason=str(req.description)[:500]))

    def _warn_left_off(self, names: Collection[str]) -> None:
        """NVRx switches on a timeout configured null when it learns one; here learning never
        does (a rank would start being judged by a measure the launcher chose not to use).
        Say so once per timeout, with the way to get it enforced."""
        warned = vars(self).setdefault("_nvrx_left_off_warned", set())
        configured = _configured(self.cfg)
        off = [n for n in names if n in configured and configured[n] is None and n not in warned]
        if off:
            warned.update(off)
            logger.warning("timeouts %s are configured null (not enforced) and learning leaves them off; to have "
                           "them learned, configure a loose value (e.g. 3600 s) instead of null", off)


def _configured(cfg: Any) -> Dict[str, Optional[float]]:
    return {"initial_heartbeat": cfg.initial_rank_heartbeat_timeout, "heartbeat": cfg.rank_heartbeat_timeout,
            OUT_OF_SECTION: cfg.rank_out_of_section_timeout, **cfg.rank_section_timeouts}


def state_from_nvrx(state: Mapping[str, Any], version: int) -> dict:
    """NVRx's client state ({"current_timeouts": {"heartbeat": ..., "section": ...}}) as ours:
    only the values it marks as calculated (the others were its config's, not learned)."""
    current = state[NVRX_STATE_KEY]
    check(isinstance(current, Mapping), NVRX_STATE_KEY, current, "expected a mapping")
    learned: Dict[str, Any] = {"initial_heartbeat": None, "heartbeat": None, "sections": {}, OUT_OF_SECTION: None}
    try:
        heartbeat = current.get("heartbeat") or {}
        if heartbeat.get("were_calculated"):
            learned["initial_heartbeat"], learned["heartbeat"] = heartbeat.get("initial"), heartbeat.get("subsequent")
        section = current.get("section") or {}
        values = section.get("section") or {}
        learned["sections"] = {name: values.get(name) for name in section.get("calculated_sections") or ()}
        if section.get("is_out_of_section_calculated"):
            learned[OUT_OF_SECTION] = section.get("out_of_section")
    except AttributeError:
        raise ConfigError(f"{NVRX_STATE_KEY}={current!r:.200}: not nvidia-resiliency-ext's client state") from None
    return {"version": version, "calculated_timeouts": learned}
