"""Health checks on this CPU-only machine, plus the parsing of NVML answers.

The first tests use the real environment: no NVML library, a CPU build of torch, so every
check must say "not applicable" and let the job go on.

The rest use FakeNvml, a stand-in for the `pynvml` module. It exists because there is no
GPU and no NVML here; it only exercises how the checks read NVML's answers (recovery
action, pending retirement, row remapping, ECC, clock reasons, NVLink states, "not
supported" errors). bench/gpu_check.sh runs the same checks against the real NVML on a GPU.
"""

import types

import pytest

from nvrx_core import events as ev
from nvrx_core.health import (ChainedGPUHealthCheck, CudaHealthCheck, GPUHealthCheck, HealthCheckChain, HealthResult,
                              NVLHealthCheck, NvmlSession, Status, check_device, node_health_check)
from nvrx_core.inprocess.health_gate import HealthGate


# ---- the real environment ------------------------------------------------------------------
def test_without_nvml_every_check_is_not_applicable():
    for check in (GPUHealthCheck(), NVLHealthCheck(), CudaHealthCheck(), ChainedGPUHealthCheck()):
        result = check()
        assert result.status == Status.NOT_APPLICABLE and result.healthy, result
    healthy, detail = node_health_check()
    assert healthy and detail.startswith("not_applicable")


def test_missing_package_is_reported_once_with_the_install_hint():
    imports = []

    def importer(name):
        imports.append(name)
        raise ImportError(name)

    session = NvmlSession(importer=importer)
    for _ in range(3):
        result = GPUHealthCheck(nvml=session)()
        assert result.status == Status.NOT_APPLICABLE and "pip install 'nvrx-suite[gpu]'" in result.detail
    assert imports == ["pynvml"]  # once per process, not per check


# ---- NVML answers (FakeNvml: no GPU here) -----------------------------------------------------
class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml(types.SimpleNamespace):
    """Just enough of pynvml's surface, with per-device answers set by each test."""

    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_INVALID_ARGUMENT = 2
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_FEATURE_DISABLED, NVML_FEATURE_ENABLED = 0, 1
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
    NVML_GPU_RECOVERY_ACTION_NONE = 0
    NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
    NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_NVLINK_MAX_LINKS = 4
    nvmlClocksEventReasonGpuIdle = 0x1
    nvmlClocksEventReasonHwSlowdown = 0x8
    nvmlClocksEventReasonHwThermalSlowdown = 0x40
    nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
    NVMLError = NVMLError

    def __init__(self, devices):
        super().__init__()
        self.devices = devices  # list of dicts, one per GPU
        self.init_calls = 0

    def nvmlInit(self):
        self.init_calls += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.devices[index]

    def _answer(self, device, key, default):
        value = device.get(key, default)
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlDeviceGetFieldValues(self, device, fields):
        action = self._answer(device, "recovery", 0)
        value = types.SimpleNamespace(uiVal=action)
        return [types.SimpleNamespace(nvmlReturn=device.get("recovery_return", 0), value=value)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device):
        return self._answer(device, "retired_pending", 0)

    def nvmlDeviceGetRemappedRows(self, device):
        return self._answer(device, "remapped", (0, 0, 0, 0))

    def nvmlDeviceGetTotalEccErrors(self, device, error_type, counter_type):
        assert (error_type, counter_type) == (1, 0)
        return self._answer(device, "ecc", 0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, device):
        return self._answer(device, "clocks", 0x1)

    def nvmlDeviceGetNvLinkState(self, device, link):
        links = device.get("links", [])
        if link >= len(links):
            raise NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return links[link]


def session(*devices):
    fake = FakeNvml(list(devices))
    return fake, NvmlSession(module=fake)


def test_healthy_gpu_and_nvlink():
    fake, nvml = session({"links": [1, 1, 1]})
    assert GPUHealthCheck(nvml=nvml)().status == Status.HEALTHY
    result = NVLHealthCheck(nvml=nvml)()
    assert result.status == Status.HEALTHY and "3 links up" in result.detail


@pytest.mark.parametrize("device, words", [
    ({"recovery": 1}, "recovery action gpu_reset"),
    ({"recovery": 2}, "recovery action node_reboot"),
    ({"retired_pending": 1}, "page retirement pending"),
    ({"remapped": (5, 1, 1, 0)}, "row remapping pending"),
    ({"remapped": (0, 0, 0, 1)}, "row remapping failed"),
    ({"ecc": 3}, "3 uncorrected ECC errors"),
    ({"clocks": 0x1 | 0x40}, "hw_thermal_slowdown"),
    ({"recovery": NVMLError(15)}, "recovery action: NVML error"),
])
def test_each_nvml_answer_that_means_trouble_is_unhealthy(device, words):
    _, nvml = session({}, device)
    result = GPUHealthCheck(nvml=nvml)()
    assert result.status == Status.UNHEALTHY and words in result.detail, result.detail
    assert result.detail.startswith("gpu1")  # the failing device is named, the healthy one not shown


def test_unsupported_items_are_skipped_not_failed():
    _, nvml = session({"retired_pending": NVMLError(3), "recovery_return": 3, "ecc": NVMLError(3)})
    result = GPUHealthCheck(nvml=nvml)()
    assert result.status == Status.HEALTHY
    assert "not supported: recovery action, retired pages, uncorrected ECC" in result.detail


def test_idle_or_software_clock_reasons_are_not_faults():
    _, nvml = session({"clocks": 0x1 | 0x4})
    assert GPUHealthCheck(nvml=nvml)().healthy
    _, nvml = session({"clocks": 0x8})
    assert GPUHealthCheck(nvml=nvml, fatal_throttle_reasons=["hw_power_brake_slowdown"])().healthy
    with pytest.raises(ValueError, match="unknown"):
        GPUHealthCheck(fatal_throttle_reasons=["cosmic_rays"])


def test_a_down_nvlink_is_unhealthy_and_no_nvlink_is_not_applicable():
    _, nvml = session({"links": [1, 0, 1]})
    result = NVLHealthCheck(nvml=nvml)()
    assert result.status == Status.UNHEALTHY and "links down: 1 of 3" in result.detail
    _, nvml = session({"links": []})
    assert NVLHealthCheck(nvml=nvml)().status == Status.NOT_APPLICABLE


def test_one_device_is_checked_alone_and_nvml_is_initialised_once(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake, nvml = session({"links": [1]}, {"ecc": 1, "links": [1]})
    assert check_device(0, nvml).status == Status.HEALTHY
    bad = check_device(1, nvml)
    assert bad.status == Status.UNHEALTHY and bad.device == 1 and "ECC" in bad.detail
    assert fake.init_calls == 1


def test_local_device_follows_cuda_visible_devices(monkeypatch):
    fake, nvml = session({}, {}, {"recovery": 1})
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")  # CUDA device 1 is NVML device 2
    result = ChainedGPUHealthCheck(nvml=nvml)()
    assert result.status == Status.UNHEALTHY and result.device == 1


def test_nvml_that_cannot_start_is_not_applicable():
    fake = FakeNvml([])

    def broken_init():
        raise NVMLError(9)  # driver not loaded

    fake.nvmlInit = broken_init
    result = GPUHealthCheck(nvml=NvmlSession(module=fake))()
    assert result.status == Status.NOT_APPLICABLE and "NVML cannot start" in result.detail


# ---- chains and the Wrapper's gate -------------------------------------------------------------
def test_chain_reports_every_check_and_a_broken_one_as_unhealthy(tmp_path):
    def broken():
        raise RuntimeError("driver exploded")

    log = ev.EventLog(str(tmp_path / "events.jsonl"), rank=3)
    results = HealthCheckChain(lambda: HealthResult("a", Status.HEALTHY), broken, GPUHealthCheck(), events=log)()
    assert [r.status for r in results] == [Status.HEALTHY, Status.UNHEALTHY, Status.NOT_APPLICABLE]
    assert "driver exploded" in results[1].detail
    recorded = ev.read_events(str(tmp_path / "events.jsonl"))
    assert [(e["kind"], e["rank"], e["check"], e["status"]) for e in recorded] == [
        ("health_check", 3, "a", "healthy"), ("health_check", 3, "broken", "unhealthy"),
        ("health_check", 3, "gpu", "not_applicable")]


def test_gate_accepts_results_lists_and_launcher_tuples(tmp_path):
    log = ev.EventLog(str(tmp_path / "events.jsonl"), rank=0)
    assert HealthGate(None).run(log, 0) == (True, [])
    assert HealthGate(lambda: (False, "bad gpu")).run(log, 1)[0] is False
    healthy, results = HealthGate(HealthCheckChain(CudaHealthCheck())).run(log, 2)
    assert healthy and results[0].status == Status.NOT_APPLICABLE
    assert HealthGate(lambda: 42).run(log, 3)[0] is False  # a wrong answer type fails the check
    recorded = [e for e in ev.read_events(str(tmp_path / "events.jsonl")) if e["kind"] == ev.HEALTH_CHECK]
    assert [(e["iteration"], e["status"]) for e in recorded] == [(1, "unhealthy"), (2, "not_applicable"),
                                                                 (3, "unhealthy")]
