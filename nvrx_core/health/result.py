"""The result of one health check."""

import dataclasses
import enum
from typing import Iterable, Optional


class Status(str, enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    NOT_APPLICABLE = "not_applicable"
    """The check cannot run here (no NVML, no GPU, no NVLink): not a failure."""


@dataclasses.dataclass(frozen=True)
class HealthResult:
    check: str
    status: Status
    detail: str = ""
    device: Optional[int] = None

    @property
    def healthy(self) -> bool:
        """False only for a real failure; "not applicable" lets the job go on."""
        return self.status != Status.UNHEALTHY

    def to_dict(self) -> dict:
        return {"check": self.check, "status": self.status.value, "detail": self.detail, "device": self.device}

    @classmethod
    def combine(cls, check: str, results: Iterable["HealthResult"], device: Optional[int] = None) -> "HealthResult":
        """One result for several: unhealthy if any is, healthy if any ran, else not applicable."""
        results = list(results)
        statuses = {r.status for r in results}
        if Status.UNHEALTHY in statuses:
            status = Status.UNHEALTHY
            shown = [r for r in results if r.status == Status.UNHEALTHY]
        elif Status.HEALTHY in statuses:
            status, shown = Status.HEALTHY, [r for r in results if r.status == Status.HEALTHY]
        else:
            status, shown = Status.NOT_APPLICABLE, results
        detail = "; ".join(f"{r.check}: {r.detail}" if r.detail else r.check for r in shown)
        return cls(check, status, detail, device)
