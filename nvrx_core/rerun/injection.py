"""Error injection: exercise the whole rerun protocol on a healthy machine.

An injected fault makes one validation reject its result, then decides how the reruns
compare, so each path of the protocol can be driven on purpose:
- transient_error: the in-place rerun differs (exit 17 if the check is fatal, else go on);
- persistent_error: the in-place rerun reproduces, the rerun on another device differs;
- correct_result: both reruns reproduce (an application/data problem).
The injected type is stored with the rejected call, so it survives the checkpoint that
moves the job to another device.
"""

import math
import random
from typing import Optional

from nvrx_core.rerun.config import RerunDiagnostic

MATCH = 0.0
MISMATCH = math.inf


class RerunErrorInjector:
    def __init__(self, rate: int, kind: RerunDiagnostic, rng: Optional[random.Random] = None):
        if rate < 0:
            raise ValueError(f"error_injection_rate={rate}: must be >= 0")
        self.rate = rate
        self.kind = RerunDiagnostic(kind)
        self._rng = rng if rng is not None else random.Random()

    def draw(self) -> Optional[RerunDiagnostic]:
        """For one validation of an initial run: the fault to inject, or None (1 in `rate`)."""
        if self.rate > 0 and self._rng.randint(1, self.rate) == 1:
            return self.kind
        return None

    @staticmethod
    def in_place_comparison(kind: RerunDiagnostic) -> float:
        """How an injected fault's result compares when rerun on the same device."""
        return MISMATCH if kind is RerunDiagnostic.TRANSIENT_ERROR else MATCH

    @staticmethod
    def elsewhere_comparison(kind: RerunDiagnostic) -> float:
        """How an injected fault's result compares when rerun on another device."""
        return MISMATCH if kind is RerunDiagnostic.PERSISTENT_ERROR else MATCH
