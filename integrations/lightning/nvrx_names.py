"""nvidia-resiliency-ext's Lightning callbacks (`nvidia_resiliency_ext.ptl_resiliency`) by name.

    from nvrx_lightning import FaultToleranceCallback, FaultToleranceSectionsCallback, SimulatedFaultParams
    from nvrx_lightning import StragglerDetectionCallback

Each is NVRxFaultTolerance or NVRxStragglerDetection with the peer's argument names, order
and defaults, and the attributes code written for it reads (`simulated_fault_params`,
`autoresume`, `fault_tol_client`, `exc_handling_policy`), so a callback list ports by
changing the import. The callbacks of both names send heartbeats and sections alike
(whichever the launcher enforces protects the job), so the sections one differs from the
heartbeat one only by its `exc_handling_policy`. docs/migrating.md lists what differs.
"""

import dataclasses
import pathlib
from typing import Any, Callable, Mapping, Optional, Union

from nvrx_core.config import ConfigError, check
from nvrx_core.ft import finished
from nvrx_core.ft.client import RankMonitorClient
from nvrx_core.ft.faults import SimulatedFault
from nvrx_core.ft.nvrx_names import WorkloadAction, WorkloadControlRequest, WorkloadControlUnavailable

from nvrx_lightning.fault_tolerance import NVRxFaultTolerance
from nvrx_lightning.straggler import NVRxStragglerDetection

FT_LOGGER = "nemo_logger.FaultToleranceCallback"
"""The peer's default logger name: logging configured for it keeps receiving the callback's lines."""


@dataclasses.dataclass
class SimulatedFaultParams:
    """nvidia-resiliency-ext's time-based simulated fault, with its field names: fires
    base_delay + uniform(0, rand_delay) seconds after setup, in rank_to_fail (None: a
    random rank)."""

    fault_type: str
    base_delay: float
    rand_delay: float = 0.0
    rank_to_fail: Optional[int] = None

    def to_simulated_fault(self) -> SimulatedFault:
        return SimulatedFault(fault_type=self.fault_type, rank_to_fail=self.rank_to_fail,
                              base_delay=self.base_delay, jitter=self.rand_delay)


class FaultToleranceCallback(NVRxFaultTolerance):
    """NVRxFaultTolerance under nvidia-resiliency-ext's name and arguments: `autoresume` is
    write_finished_flag, `exp_dir` is state_dir, `simulated_fault_params` a
    SimulatedFaultParams (or a dict of its fields)."""

    def __init__(self, autoresume: bool, calculate_timeouts: bool,
                 simulated_fault_params: Union[SimulatedFaultParams, dict, None] = None,
                 exp_dir: Union[str, pathlib.Path, None] = None, logger_name: Optional[str] = FT_LOGGER):
        params = _fault_params(simulated_fault_params)
        try:
            fault = None if params is None else params.to_simulated_fault()
        except ConfigError as e:
            raise ConfigError(f"simulated_fault_params: {e}") from None
        super().__init__(calculate_timeouts=calculate_timeouts, state_dir=exp_dir, write_finished_flag=autoresume,
                         simulated_fault=fault, logger_name=logger_name or FT_LOGGER)
        self.simulated_fault_params = params

    @property
    def autoresume(self) -> bool:
        return self.write_finished_flag

    @property
    def fault_tol_client(self) -> Optional[RankMonitorClient]:
        """The rank's client while a fit is monitored (None before setup, after teardown and
        outside ft_launcher), as the peer's attribute of that name."""
        return self._loop.client if self._loop is not None else None

    @property
    def is_initialized(self) -> bool:
        return self.fault_tol_client is not None


class FaultToleranceSectionsCallback(FaultToleranceCallback):
    """nvidia-resiliency-ext's section-based callback. `exc_handling_policy(exception)` is
    called on the rank whose fit raised, before the rank leaves the monitor, and returns a
    WorkloadControlRequest, sent to ft_launcher, which acts on it at the failure that follows:
    ShutdownWorkload ends the job on every node (exit 24) and also writes the finished flag (so
    ft_launcher, started again by a scheduler, exits 0 at once), as the peer does;
    ExcludeThisNode takes this node out of the job (exit 25), the others go on."""

    def __init__(self, autoresume: bool, calculate_timeouts: bool,
                 simulated_fault_params: Union[SimulatedFaultParams, dict, None] = None,
                 exp_dir: Union[str, pathlib.Path, None] = None, logger_name: Optional[str] = FT_LOGGER,
                 exc_handling_policy: Optional[Callable[[Exception], WorkloadControlRequest]] = None):
        check(exc_handling_policy is None or callable(exc_handling_policy), "exc_handling_policy",
              exc_handling_policy, "must be a function of the exception returning a WorkloadControlRequest, or None")
        super().__init__(autoresume, calculate_timeouts, simulated_fault_params, exp_dir, logger_name)
        self.exc_handling_policy = exc_handling_policy

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        client = self.fault_tol_client
        try:
            if client is not None and self.exc_handling_policy is not None:
                self._apply_policy(client, exception, trainer.is_global_zero)
        finally:
            super().on_exception(trainer, pl_module, exception)

    def _apply_policy(self, client: RankMonitorClient, exception: BaseException, global_zero: bool) -> None:
        request = self.exc_handling_policy(exception)
        check(isinstance(request, WorkloadControlRequest), "exc_handling_policy", request,
              "must return a WorkloadControlRequest")
        self._logger.info("exception handling policy returned %r", request)
        if request.action is WorkloadAction.ShutdownWorkload:
            path = finished.write_finished_flag()
            if path:
                self._logger.warning("workload shutdown requested: wrote the finished flag %s", path)
        try:
            client.send_workload_control_request(request)
        except WorkloadControlUnavailable as e:
            self._logger.error("%s", e)


class StragglerDetectionCallback(NVRxStragglerDetection):
    """NVRxStragglerDetection with nvidia-resiliency-ext's signature (every argument but the
    last two required, its logger name). stop_if_detected saves a checkpoint and exits 19
    (STRAGGLER_STOP: ft_launcher stops) where the peer's exits 1 (and its launcher restarts)."""

    def __init__(self, report_time_interval: float, calc_relative_gpu_perf: bool, calc_individual_gpu_perf: bool,
                 num_gpu_perf_scores_to_print: int, gpu_relative_perf_threshold: float,
                 gpu_individual_perf_threshold: float, stop_if_detected: bool, enable_ptl_logging: bool,
                 profiling_interval: int = 1, logger_name: Optional[str] = "nemo_logger.StragglerDetectionCallback"):
        super().__init__(report_time_interval, calc_relative_gpu_perf, calc_individual_gpu_perf,
                         num_gpu_perf_scores_to_print, gpu_relative_perf_threshold, gpu_individual_perf_threshold,
                         stop_if_detected, enable_ptl_logging, profiling_interval, logger_name)


def _fault_params(value: Any) -> Optional[SimulatedFaultParams]:
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(SimulatedFaultParams)}
        unknown = sorted(set(value) - known)
        check(not unknown, "simulated_fault_params", unknown, f"unknown fields; known: {sorted(known)}")
        try:
            value = SimulatedFaultParams(**value)
        except TypeError as e:
            raise ConfigError(f"simulated_fault_params: {e}") from None
    check(value is None or isinstance(value, SimulatedFaultParams), "simulated_fault_params", value,
          "must be a SimulatedFaultParams, a dict of its fields or None")
    return value


__all__ = ["SimulatedFaultParams", "FaultToleranceCallback", "FaultToleranceSectionsCallback",
           "StragglerDetectionCallback"]
