"""nvidia-resiliency-ext's public fault-tolerance API under its own names (issue 30).

Config constructors and YAML, the client's NVRx attributes against a real node monitor, the
Lightning callbacks' NVRx arguments on a real Trainer, signatures and YAML files compared with
the installed nvidia-resiliency-ext 0.4.1 (.venv-peer, when built: `make peer`), and the
acceptance script examples/nvrx_compat/train.py recovering from a killed and a hung rank under
our ft_launcher and, when .venv-peer exists, under nvidia-resiliency-ext's own.
"""

import argparse
import dataclasses
import inspect
import json
import logging
import os
import runpy
import subprocess

import pytest
import torch

from harness.launcher import REPO, kill_tree, kinds, run_launcher
from harness.node_monitor import NodeMonitorOnThread
from test_lightning_ft import TinyModel
from nvrx_core.config import ConfigError
from nvrx_core.events import read_events
from nvrx_core.ft import (FaultToleranceConfig, FTConfig, HeartbeatTimeouts, RankMonitorClient, RankMonitorClientError,
                          SectionTimeouts, WorkloadAction, WorkloadControlRequest)
from nvrx_core.ft.config import PEER_ONLY_FIELDS
from harness import wait_for

import nvrx_lightning
from nvrx_lightning import FaultToleranceCallback, FaultToleranceSectionsCallback, SimulatedFaultParams
from nvrx_lightning._compat import pl

pytestmark = pytest.mark.timeout(400)

EXAMPLE = os.path.join(REPO, "examples", "nvrx_compat", "train.py")
PEER = os.path.join(REPO, ".venv-peer")
PEER_PYTHON = os.path.join(PEER, "bin", "python")
NO_PEER = "nvidia-resiliency-ext is not installed in .venv-peer (`make peer` builds it; CI does not)"
peer_only = pytest.mark.skipif(not os.path.exists(os.path.join(PEER, ".installed")), reason=NO_PEER)


# ---- FaultToleranceConfig ---------------------------------------------------------------

def test_from_kwargs_keeps_fields_drops_the_rest_with_a_warning_or_refuses_them(caplog):
    assert FaultToleranceConfig is FTConfig
    with caplog.at_level(logging.WARNING, logger="nvrx.ft"):
        cfg = FaultToleranceConfig.from_kwargs(rank_heartbeat_timeout=30, enable_nic_monitor=False, heartbeat_timout=9)
    assert cfg.rank_heartbeat_timeout == 30 and cfg.initial_rank_heartbeat_timeout == 3600
    assert "enable_nic_monitor" in caplog.text and "heartbeat_timout" in caplog.text
    with pytest.raises(ValueError, match="heartbeat_timout"):
        FaultToleranceConfig.from_kwargs(ignore_not_recognized=False, heartbeat_timout=9)
    with pytest.raises(ConfigError, match=r"safety_factor=0.5: must be >= 1.*set the timeouts themselves"):
        FaultToleranceConfig.from_kwargs(safety_factor=0.5)
    assert FaultToleranceConfig.from_kwargs(log_level="DBG").log_level == logging.DEBUG


def test_yaml_file_round_trip_nested_section_and_errors(tmp_path, caplog):
    cfg = FaultToleranceConfig(rank_section_timeouts={"setup": 600, "step": None}, rank_out_of_section_timeout=90,
                               rank_termination_signal="SIGTERM", log_level="DEBUG")
    path = str(tmp_path / "ft.yaml")
    cfg.to_yaml_file(path)
    assert FaultToleranceConfig.from_yaml_file(path) == cfg
    assert FTConfig.from_layers(path) == cfg                    # what ft_launcher --ft-cfg-path reads
    nested = tmp_path / "nested.yaml"
    nested.write_text("trainer: {max_steps: 3}\nexp:\n  fault_tolerance:\n    safety_factor: 7\n"
                      "    use_infra_group_rank: true\n    skip_section_response: true\n")
    with caplog.at_level(logging.WARNING, logger="nvrx.ft"):
        assert FaultToleranceConfig.from_yaml_file(str(nested)).safety_factor == 7
    assert "--ft-use-infra-group-rank" in caplog.text
    (tmp_path / "none.yaml").write_text("trainer: {max_steps: 3}\n")
    with pytest.raises(ValueError, match="no 'fault_tolerance:' section"):
        FaultToleranceConfig.from_yaml_file(str(tmp_path / "none.yaml"))


def test_from_args_layers_the_file_and_ft_arguments(tmp_path):
    path = tmp_path / "ft.yaml"
    FaultToleranceConfig(safety_factor=8, rank_heartbeat_timeout=50).to_yaml_file(str(path))
    args = argparse.Namespace(ft_cfg_path=str(path), ft_rank_section_timeouts="step:30,setup:None",
                              ft_safety_factor=None, ft_log_level="WARN", ft_node_health_check_interval="5")
    cfg = FaultToleranceConfig.from_args(args)
    assert (cfg.safety_factor, cfg.rank_heartbeat_timeout, cfg.log_level) == (8, 50, logging.WARNING)
    assert cfg.rank_section_timeouts == {"step": 30.0, "setup": None}
    (tmp_path / "other.yaml").write_text("model: {}\n")          # no section: defaults, then the arguments
    cfg = FaultToleranceConfig.from_args(argparse.Namespace(ft_cfg_path=str(tmp_path / "other.yaml"),
                                                            ft_rank_heartbeat_timeout="12"))
    assert (cfg.rank_heartbeat_timeout, cfg.safety_factor) == (12, 5)
    assert FaultToleranceConfig.from_args(argparse.Namespace()) == FaultToleranceConfig()
    with pytest.raises(ConfigError, match="does not exist"):
        FaultToleranceConfig.from_args(argparse.Namespace(ft_cfg_path=str(tmp_path / "missing.yaml")))


# ---- RankMonitorClient's NVRx names, against a real node monitor --------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def monitor(tmp_path):
    cfg = FTConfig(rank_section_timeouts={"setup": 600, "step": 60, "ckpt": None}, rank_out_of_section_timeout=None,
                   min_calculated_timeout=0, num_warmup_iterations=0, stack_dump_grace=0.05)
    served = NodeMonitorOnThread(tmp_path, config=cfg, send_signal=lambda watch, sig: True)   # nobody is signalled
    yield served
    served.close()


def test_client_attributes_and_learning_under_nvrx_names(monitor, caplog):
    clock = Clock()
    client = RankMonitorClient(socket_path=monitor.path, clock=clock)
    assert client.cfg is None and client.hb_timeouts is None and not client.is_initialized
    client.init_workload_monitoring()
    try:
        assert client.cfg.rank_section_timeouts == {"setup": 600, "step": 60, "ckpt": None}
        assert client.hb_timeouts == HeartbeatTimeouts(3600, 2700, False)
        with pytest.raises(RankMonitorClientError, match="initial_heartbeat, heartbeat"):
            client.calculate_and_set_hb_timeouts()
        assert client.calculate_and_set_hb_timeouts(skip_if_not_ready=True) is False
        for t in (101.0, 102.0, 104.0):                       # first after 1 s, then gaps of 1 s and 2 s
            clock.now = t
            client.send_heartbeat()
        assert client.calculate_and_set_hb_timeouts() is True
        assert client.hb_timeouts == HeartbeatTimeouts(5.0, 10.0, True)
        watch = monitor.watch(os.getpid())
        wait_for(lambda: watch.timeouts.heartbeat == 10.0, what="the learned heartbeat timeout enforced")

        for name, seconds in (("step", 0.5), ("ckpt", 3.0)):
            client.start_section(name)
            clock.now += seconds
            client.end_section(name)
        with pytest.raises(ConfigError, match=r"selected_sections=\['stepp'\]: not in rank_section_timeouts"):
            client.calculate_and_set_section_timeouts(selected_sections=["stepp"])
        with pytest.raises(RankMonitorClientError, match="out_of_section"):   # no gap between sections yet
            client.calculate_and_set_section_timeouts(selected_sections=["step"])
        with caplog.at_level(logging.WARNING, logger="nvrx.ft.client"):
            assert client.calculate_and_set_section_timeouts(["step", "ckpt"], calc_out_of_section=False)
        assert "['ckpt'] are configured null" in caplog.text   # NVRx would switch it on: said, with the way
        sections = client.section_timeouts
        assert sections.section == {"setup": 600, "step": 2.5, "ckpt": None}
        assert sections.calculated_sections == {"step"} and not sections.is_out_of_section_calculated
        assert client.hb_timeouts == HeartbeatTimeouts(5.0, 10.0, True)       # untouched by the section call
        wait_for(lambda: watch.timeouts.sections["step"] == 2.5, what="the learned step timeout enforced")

        restored = RankMonitorClient(socket_path="")
        restored.load_state_dict(client.state_dict())
        assert restored.calculated == client.calculated
    finally:
        client.shutdown_workload_monitoring()


def test_client_state_in_nvrx_form_loads_its_calculated_values_only():
    client = RankMonitorClient(socket_path="")
    client.load_state_dict({"current_timeouts": {
        "heartbeat": {"initial": 7.0, "subsequent": 3.0, "were_calculated": True},
        "section": {"section": {"step": 4.0, "setup": 600.0}, "out_of_section": 9.0,
                    "calculated_sections": ["step"], "is_out_of_section_calculated": False}}})
    learned = client.calculated
    assert (learned.initial_heartbeat, learned.heartbeat, learned.sections, learned.out_of_section) == (
        7.0, 3.0, {"step": 4.0}, None)
    client.load_state_dict({})                                  # a checkpoint without FT state: nothing
    assert client.calculated == learned
    with pytest.raises(ConfigError, match="current_timeouts"):
        client.load_state_dict({"current_timeouts": {"heartbeat": "x"}})


def test_outside_ft_launcher_and_unreachable_monitor(tmp_path):
    idle = RankMonitorClient(socket_path="")
    assert idle.init_workload_monitoring() is False
    assert idle.calculate_and_set_hb_timeouts() is False and idle.calculate_and_set_section_timeouts() is False
    with pytest.raises(RankMonitorClientError) as caught:
        RankMonitorClient(socket_path=str(tmp_path / "no.sock")).init_workload_monitoring(connect_timeout=2)
    assert isinstance(caught.value, ConnectionError)            # nvrx-suite code catches that name
    idle.send_workload_control_request(WorkloadControlRequest(WorkloadAction.Continue))
    with pytest.raises(RankMonitorClientError, match="not connected to ft_launcher") as caught:
        idle.send_workload_control_request(WorkloadControlRequest(WorkloadAction.ShutdownWorkload, "bad node"))
    assert isinstance(caught.value, RuntimeError)               # NVRx raises RuntimeError there
    with pytest.raises(ConfigError, match="req="):
        idle.send_workload_control_request("stop")


# ---- Lightning callbacks under NVRx's names ---------------------------------------------

class Failing(TinyModel):
    """test_lightning_ft's model, raising at step `fail_at`."""

    def __init__(self, fail_at):
        super().__init__()
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.fail_at:
            raise KeyError("lost a shard")
        return super().training_step(batch, batch_idx)


def fit(root, callback, fail_at):
    seen = []

    class During(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(callback.fault_tol_client is not None and callback.fault_tol_client.is_initialized)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[callback, During()],
                         default_root_dir=root, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Failing(fail_at))
    return seen


def test_sections_callback_applies_the_exception_policy_and_cleans_up(tmp_path, monkeypatch, caplog):
    served = NodeMonitorOnThread(tmp_path, send_signal=lambda watch, sig: True)
    try:
        monkeypatch.setenv("NVRX_FT_MONITOR_SOCKET", served.path)
        monkeypatch.setenv("FAULT_TOL_FINISHED_FLAG_FILE", str(tmp_path / "finished"))
        policy_saw = []

        def shutdown(exc):
            policy_saw.append(type(exc))
            return WorkloadControlRequest(WorkloadAction.ShutdownWorkload, "data is corrupt")
        callback = FaultToleranceSectionsCallback(autoresume=False, calculate_timeouts=True,
                                                  exp_dir=tmp_path / "ft", exc_handling_policy=shutdown)
        assert callback.fault_tol_client is None and callback.autoresume is False
        with caplog.at_level(logging.ERROR, logger="nemo_logger.FaultToleranceCallback"):
            with pytest.raises(KeyError, match="lost a shard"):
                seen = fit(tmp_path, callback, fail_at=3)
        assert policy_saw == [KeyError]
        assert (tmp_path / "finished").exists()                 # as the peer: shutdown writes the flag
        requests = lambda: [e for e in read_events(served.events_file) if e["kind"] == "workload_request"]
        wait_for(requests, what="the monitor thread recorded the rank's request")   # it reads the socket on its own
        [request] = requests()
        assert (request["action"], request["reason"]) == ("ShutdownWorkload", "data is corrupt")  # for the launcher
        assert callback.fault_tol_client is None
        wait_for(lambda: served.watch(os.getpid()) is None, what="the rank left the monitor")

        callback = FaultToleranceSectionsCallback(True, True, exc_handling_policy=lambda exc: "stop")
        with pytest.raises(ConfigError, match="exc_handling_policy='stop': must return a WorkloadControlRequest"):
            fit(tmp_path, callback, fail_at=2)
        assert callback.fault_tol_client is None               # undone though the policy was wrong
        wait_for(lambda: served.watch(os.getpid()) is None, what="the rank left the monitor")

        callback = FaultToleranceCallback(False, False)
        seen = fit(tmp_path, callback, fail_at=-1)
        assert seen and all(seen)
    finally:
        served.close()
    with pytest.raises(ConfigError, match="exc_handling_policy"):
        FaultToleranceSectionsCallback(True, True, exc_handling_policy="shutdown")
    ported = FaultToleranceSectionsCallback(True, True, simulated_fault_params={"fault_type": "rank_hung",
                                                                                "base_delay": 9})
    assert ported.simulated_fault_params == SimulatedFaultParams("rank_hung", 9.0)
    assert ported.simulated_fault.base_delay == 9.0


# ---- against the installed nvidia-resiliency-ext ----------------------------------------

PEER_PROBE = r"""
import dataclasses, inspect, json, sys
from nvidia_resiliency_ext import fault_tolerance as ft, ptl_resiliency as ptl
from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts, SectionTimeouts

def sig(fn):
    return [[p.name, p.kind.name, "<required>" if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(fn).parameters.values() if p.name != "self"]

def fields(cls):
    return [[f.name, repr(f.default) if f.default is not dataclasses.MISSING else "<factory>"]
            for f in dataclasses.fields(cls)]

C = ft.FaultToleranceConfig
out = {"signatures": {}, "fields": {}}
for name in ("from_kwargs", "from_yaml_file", "from_args", "to_yaml_file"):
    out["signatures"]["FaultToleranceConfig." + name] = sig(getattr(C, name))
for name in ("__init__", "init_workload_monitoring", "shutdown_workload_monitoring", "send_heartbeat",
             "start_section", "end_section", "end_all_sections", "calculate_and_set_hb_timeouts",
             "calculate_and_set_section_timeouts", "state_dict", "load_state_dict", "send_workload_control_request"):
    out["signatures"]["RankMonitorClient." + name] = sig(getattr(ft.RankMonitorClient, name))
for name in ("FaultToleranceCallback", "FaultToleranceSectionsCallback", "StragglerDetectionCallback"):
    out["signatures"][name] = sig(getattr(ptl, name).__init__)
for cls in (C, ptl.SimulatedFaultParams, HeartbeatTimeouts, SectionTimeouts):
    out["fields"][cls.__name__] = fields(cls)
out["ptl"] = sorted(n for n in dir(ptl) if not n.startswith("_") and isinstance(getattr(ptl, n), type))
out["actions"] = [[a.name, a.value] for a in ft.WorkloadAction]
C(safety_factor=4.0, rank_section_timeouts={"step": 30.0}).to_yaml_file(sys.argv[1])
ours = C.from_yaml_file(sys.argv[2])
out["read_ours"] = [ours.safety_factor, dict(ours.rank_section_timeouts), ours.rank_termination_signal.name]
print(json.dumps(out))
"""


def our_callable(key):
    """Ours for the peer's "Class.method" (a config or client method) or "Callback" (its __init__)."""
    owner, _, method = key.partition(".")
    if owner in ("FaultToleranceConfig", "RankMonitorClient"):
        return getattr({"FaultToleranceConfig": FaultToleranceConfig, "RankMonitorClient": RankMonitorClient}[owner],
                       method)
    return getattr(nvrx_lightning, owner).__init__


OUR_DATACLASSES = {"FaultToleranceConfig": FaultToleranceConfig, "SimulatedFaultParams": SimulatedFaultParams,
                   "HeartbeatTimeouts": HeartbeatTimeouts, "SectionTimeouts": SectionTimeouts}


@peer_only
def test_names_signatures_fields_and_yaml_files_match_the_installed_nvidia_resiliency_ext(tmp_path):
    ours_yaml = str(tmp_path / "ours.yaml")
    FaultToleranceConfig(safety_factor=6.0, rank_section_timeouts={"setup": 90.0}).to_yaml_file(ours_yaml)
    peer_yaml = str(tmp_path / "peer.yaml")
    probe = subprocess.run([PEER_PYTHON, "-c", PEER_PROBE, peer_yaml, ours_yaml], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert probe.returncode == 0, probe.stderr[-3000:]
    peer = json.loads(probe.stdout.splitlines()[-1])
    for key, theirs in peer["signatures"].items():
        mine = [[p.name, p.kind.name, "<required>" if p.default is p.empty else repr(p.default)]
                for p in inspect.signature(our_callable(key)).parameters.values() if p.name != "self"]
        assert mine[:len(theirs)] == theirs, key               # theirs, in order, same kinds and defaults
        assert all(default != "<required>" for _, _, default in mine[len(theirs):]), key  # ours adds options only
    for name, theirs in peer["fields"].items():
        mine = {f.name: (repr(f.default) if f.default is not dataclasses.MISSING else "<factory>")
                for f in dataclasses.fields(OUR_DATACLASSES[name])}
        shared = [field for field, _ in theirs if field in mine]
        assert shared == [field for field in mine if field in dict(theirs)], name   # same relative order
        for field, default in theirs:
            assert field in PEER_ONLY_FIELDS or mine.get(field) == default, (name, field)
    assert set(peer["ptl"]) <= set(nvrx_lightning.__all__)
    assert peer["actions"] == [[a.name, a.value] for a in WorkloadAction]
    assert peer["read_ours"] == [6.0, {"setup": 90.0}, "SIGKILL"]   # NVRx reads the file ours writes
    theirs = FaultToleranceConfig.from_yaml_file(peer_yaml)     # and ours (and ft_launcher) read NVRx's
    assert (theirs.safety_factor, theirs.rank_section_timeouts) == (4.0, {"step": 30.0})
    assert FTConfig.from_layers(peer_yaml) == theirs


# ---- the acceptance script: a killed and a hung rank, ours and NVRx's launcher ------------

FAULTS = ["--kill-rank", "1", "--kill-at", "6", "--hang-rank", "0", "--hang-at", "14"]


def results(out):
    return [json.loads((out / f"result.rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ft_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "ft.yaml"
    runpy.run_path(EXAMPLE, run_name="nvrx_compat_example")["write_ft_config"](str(path))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, ft_yaml):
    out = tmp_path_factory.mktemp("reference")
    run = run_launcher(["--nproc-per-node", "2", "--max-restarts", "0", "--ft-cfg-path", str(ft_yaml),
                        EXAMPLE, "--out", str(out)], timeout=240)
    assert run.returncode == 0, run.stdout[-4000:]
    [r0, r1] = results(out)
    assert r0["weights"] == r1["weights"] and r0["cycle"] == 0
    return r0["weights"]


def test_the_nvrx_script_recovers_under_our_ft_launcher(tmp_path, ft_yaml, reference):
    out = tmp_path / "faults"
    run = run_launcher(["--nproc-per-node", "2", "--max-restarts", "3", "--ft-cfg-path", str(ft_yaml),
                        "--events-file", str(tmp_path / "events.jsonl"), EXAMPLE, "--out", str(out), *FAULTS],
                       timeout=300)
    assert run.returncode == 0, run.stdout[-4000:]
    events = read_events(str(tmp_path / "events.jsonl"))
    assert len(kinds(events, "restart_begun")) == 2
    assert [(r["cycle"], r["weights"]) for r in results(out)] == [(2, reference)] * 2
    # the hang was caught by a learned timeout (the configured ones are 60 s), in cycle 1
    detected = [e for e in kinds(events, "fault_detected") if e["cycle"] == 1]
    assert detected and detected[0]["time"] - os.stat(out / "hung").st_mtime < 30
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    learned = [t for t in timeline if t.get("learned_at") == 12 and t["cycle"] == 1]
    assert len(learned) == 2 and all(t["hb"]["were_calculated"] and t["calculated_sections"] == ["step"]
                                     for t in learned)
    restarted = [t for t in timeline if t.get("resumed_from") == 12]
    assert [t["cycle"] for t in restarted] == [2, 2]            # the learned values came back with the state_dict
    assert all(t["hb"] == learned[0]["hb"] and t["sections"] == learned[0]["sections"] for t in restarted)


@peer_only
def test_the_same_script_under_nvidia_resiliency_ext_ends_with_the_same_weights(tmp_path, ft_yaml, reference):
    out = tmp_path / "faults"
    env = dict(os.environ, NVRX_COMPAT_TARGET="nvrx", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("NVRX_FT_MONITOR_SOCKET", "NVRX_EVENTS_FILE", "FAULT_TOL_FINISHED_FLAG_FILE"):
        env.pop(name, None)
    proc = subprocess.Popen([os.path.join(PEER, "bin", "ft_launcher"), "--nproc-per-node", "2", "--max-restarts",
                             "3", "--ft-cfg-path", str(ft_yaml), EXAMPLE, "--out", str(out), *FAULTS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 0, log[-4000:]
    assert [(r["cycle"], r["weights"]) for r in results(out)] == [(2, reference)] * 2
    assert (out / "killed").exists() and (out / "hung").exists()
