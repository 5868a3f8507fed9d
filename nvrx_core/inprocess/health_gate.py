"""Running the Wrapper's health check after a fault and turning its answer into a verdict."""

import logging
from typing import Any, Callable, List, Optional, Tuple

from nvrx_core import events as ev
from nvrx_core.health import HealthResult, Status

logger = logging.getLogger("nvrx.inprocess")


class HealthGate:
    """Accepts a check returning a HealthResult, a list of them, or ft_launcher's (healthy, detail)."""

    def __init__(self, check: Optional[Callable[[], Any]]):
        self.check = check

    def run(self, events: ev.EventLog, iteration: int) -> Tuple[bool, List[HealthResult]]:
        if self.check is None:
            return True, []
        name = getattr(self.check, "__name__", type(self.check).__name__)
        try:
            results = normalise(name, self.check())
        except Exception as e:
            results = [HealthResult(name, Status.UNHEALTHY, f"check raised {type(e).__name__}: {e}")]
        for result in results:
            events.emit(ev.HEALTH_CHECK, iteration=iteration, **result.to_dict())
            if not result.healthy:
                logger.error("health check %s failed: %s", result.check, result.detail)
        return all(r.healthy for r in results), results


def normalise(name: str, answer: Any) -> List[HealthResult]:
    if isinstance(answer, HealthResult):
        return [answer]
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool):
        return [HealthResult(name, Status.HEALTHY if answer[0] else Status.UNHEALTHY, str(answer[1]))]
    if isinstance(answer, bool):
        return [HealthResult(name, Status.HEALTHY if answer else Status.UNHEALTHY)]
    if isinstance(answer, (list, tuple)) and all(isinstance(r, HealthResult) for r in answer):
        return list(answer)
    raise TypeError(f"health check {name} returned {type(answer).__name__}; expected HealthResult, "
                    "a list of them, or (healthy, detail)")
