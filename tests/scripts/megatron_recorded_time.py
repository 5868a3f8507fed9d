"""The reference Bridge-style trainer (examples/megatron_style/pretrain_gpt.py) on a recorded
timeline, for tests/test_megatron_trainer_all_on.py: the same flags, run under ft_launcher.

Which rank is a straggler, and its score, are decided by the durations given, never by how
late a loaded host woke a sleeping rank (docs/test_timing.md):
- the straggler manager reads a FakeClock (tests/harness/clock.py) as its clock and timer;
- each forward advances that clock by --step-time times this rank's --slow-rank factor
  instead of sleeping (the model's own compute takes no recorded time);
- the gradient all-reduce, which the trainer times as the "grad_sync" wait section, is a
  collective on the timeline (harness.timeline.all_arrive): it ends on every rank when the
  last one arrived, so the fast rank's wait for the slow one is recorded, as in real life.

The manager reaches the trainer the way a Bridge user hands one built with their own clock:
on GlobalState.nvrx_straggler_manager before pretrain(). Everything else (ft_launcher, gloo,
the model, the checkpoints, the agreed stop) is the real thing.
"""

import contextlib
import logging
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.join(os.path.dirname(TESTS), "examples", "megatron_style")]

from bridge_style import GlobalState  # noqa: E402
from harness.clock import FakeClock  # noqa: E402
from harness.timeline import all_arrive  # noqa: E402
from nvrx_megatron.nvrx_straggler import NVRxStragglerDetectionManager  # noqa: E402
import pretrain_gpt  # noqa: E402


class RecordedFaults(pretrain_gpt.LossFaults):
    """The trainer's faults, with a forward that spends recorded time instead of sleeping."""

    clock: FakeClock

    def spend(self, started: float) -> None:
        self.clock.advance(self.step_time * self.slowdown)


class RecordedManager(NVRxStragglerDetectionManager):
    """Bridge's manager on a FakeClock; a wait section is a collective on the recorded timeline."""

    def __init__(self, config, clock: FakeClock):
        super().__init__(config, clock=clock, timer=clock)
        self.recorded = clock

    def section(self, name: str, kind: str = "compute"):
        timed = super().section(name, kind)
        return self._all_arrive_in(timed) if kind == "wait" else timed

    @contextlib.contextmanager
    def _all_arrive_in(self, timed):
        with timed:
            all_arrive(self.recorded)  # the real collective inside takes no recorded time
            yield


def main(argv=None) -> int:
    args = pretrain_gpt.parse_args(argv)
    if not args.straggler:
        raise SystemExit("megatron_recorded_time.py: pass --straggler (the recorded timeline is the straggler manager's)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = pretrain_gpt.apply_overrides(pretrain_gpt.build_config(args), args.overrides)
    clock = FakeClock()  # every rank's starts at the same value: they agree after each collective
    faults = pretrain_gpt.loss_faults(args, RecordedFaults)
    faults.clock = clock
    state = GlobalState(cfg)
    state.nvrx_straggler_manager = RecordedManager(cfg.nvrx_straggler, clock)
    return pretrain_gpt.train_tiny_gpt(cfg, faults, args.result_dir, state=state)


if __name__ == "__main__":
    sys.exit(main())
