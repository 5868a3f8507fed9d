"""ft_launcher forwards every torchrun option, with torchrun's effect.

Introspection: every field of torch's LaunchConfig and WorkerSpec, and every parameter of
LocalElasticAgent.__init__, is either forwarded (nvrx_core/ft/torchrun_options.py; a value set
on the config must arrive unchanged) or listed in NOT_FORWARDED with its reason. A field a new
torch adds fails here until someone decides where it goes.

Effects: real runs of ft_launcher (warm and cold start) and of torchrun beside it with the same
options, compared on what the workers report and the files the options write.
"""

import dataclasses
import glob
import inspect
import json
import os
import shutil
import signal
import socket
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher.api import LaunchConfig

import warm_python
from harness.launcher import SCRIPTS, kill_tree, kinds
from nvrx_core.config import ConfigError
from nvrx_core.events import read_events
from nvrx_core.exit_codes import ExitCode
from nvrx_core.ft import launcher, launcher_args
from nvrx_core.ft import torchrun_options as opts
from nvrx_core.ft.agent import AgentSettings, FaultTolerantAgent
from harness import wait_for

pytestmark = pytest.mark.timeout(240)

JOB = os.path.join(SCRIPTS, "launch_options_job.py")
WITH_HEALTH_SERVER = os.path.join(SCRIPTS, "launch_with_health_server.py")


# ---- every field accounted for -------------------------------------------------------------

def dataclass_fields(cls) -> list:
    return [f.name for f in dataclasses.fields(cls)]


def parameters(function) -> list:
    return [name for name, p in inspect.signature(function).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def unaccounted(owner: str, names, forwarded) -> list:
    """The names neither forwarded nor listed as a deliberate difference of this owner."""
    return sorted(n for n in names if n not in forwarded and f"{owner}.{n}" not in opts.NOT_FORWARDED)


CONFIG_FORWARDED = {*opts.SPEC_FROM_CONFIG.values(), *opts.AGENT_FROM_CONFIG.values(),
                    *opts.RENDEZVOUS_FROM_CONFIG.values(), *opts.CONFIG_USED_BY_LAUNCHER}
SPEC_FORWARDED = {*opts.SPEC_FROM_CONFIG, *opts.SPEC_BUILT_BY_LAUNCHER}
AGENT_FORWARDED = {*opts.AGENT_FROM_CONFIG, *opts.AGENT_BUILT_BY_LAUNCHER}


def test_every_launch_config_field_is_forwarded_or_a_listed_difference():
    assert unaccounted("LaunchConfig", dataclass_fields(LaunchConfig), CONFIG_FORWARDED) == []


def test_every_worker_spec_field_is_forwarded_or_a_listed_difference():
    assert unaccounted("WorkerSpec", dataclass_fields(WorkerSpec), SPEC_FORWARDED) == []


def test_every_agent_parameter_is_forwarded_or_a_listed_difference():
    assert unaccounted("LocalElasticAgent", parameters(LocalElasticAgent.__init__), AGENT_FORWARDED) == []


def test_every_listed_difference_names_something_torch_has_and_says_why():
    """A stale entry excuses nothing today and would excuse a new field of that name tomorrow."""
    existing = {*(f"LaunchConfig.{n}" for n in dataclass_fields(LaunchConfig)),
                *(f"WorkerSpec.{n}" for n in dataclass_fields(WorkerSpec)),
                *(f"LocalElasticAgent.{n}" for n in parameters(LocalElasticAgent.__init__))}
    assert set(opts.NOT_FORWARDED) <= existing
    assert all(len(reason) > 20 for reason in opts.NOT_FORWARDED.values())


def test_the_check_fails_on_a_field_torch_adds():
    newer_config = dataclasses.make_dataclass("LaunchConfig", [("gpu_fence_timeout", int, 5)], bases=(LaunchConfig,))
    assert unaccounted("LaunchConfig", dataclass_fields(newer_config), CONFIG_FORWARDED) == ["gpu_fence_timeout"]
    newer_spec = dataclasses.make_dataclass("WorkerSpec", [("fn", object, None), ("cpu_quota", float, 0.0)],
                                            bases=(WorkerSpec,))
    assert unaccounted("WorkerSpec", dataclass_fields(newer_spec), SPEC_FORWARDED) == ["cpu_quota"]

    def newer_agent_init(self, spec, logs_specs, start_method="spawn", shutdown_timeout=30, drain_timeout=60,
                         exit_barrier_timeout=300):
        pass

    assert unaccounted("LocalElasticAgent", parameters(newer_agent_init), AGENT_FORWARDED) == ["drain_timeout"]
    # an excuse is per owner: WorkerSpec's deprecated `fn` does not excuse a LaunchConfig field `fn`
    with_fn = dataclasses.make_dataclass("LaunchConfig", [("fn", object, None)], bases=(LaunchConfig,))
    assert unaccounted("LaunchConfig", dataclass_fields(with_fn), CONFIG_FORWARDED) == ["fn"]


class Marked(int):
    """A value to follow by identity: an int (WorkerSpec and the rendezvous check ranges) that
    no default equals by accident."""


def test_forwarded_values_arrive_unchanged_in_the_spec_the_agent_and_the_rendezvous():
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    for i, name in enumerate(dataclass_fields(LaunchConfig)):
        setattr(config, name, Marked(i + 1))
    config.rdzv_configs = {"marked_option": Marked(1000)}
    built = {name: Marked(100 + i) for i, name in enumerate(opts.SPEC_BUILT_BY_LAUNCHER)}

    spec = opts.worker_spec(config, **built)
    for name, field in opts.SPEC_FROM_CONFIG.items():
        assert getattr(spec, name) is getattr(config, field), name
    for name, value in built.items():
        assert getattr(spec, name) is value, name

    options = opts.agent_options(config)
    assert set(options) == set(opts.AGENT_FROM_CONFIG)
    agent = FaultTolerantAgent(spec=spec, **options, settings=AgentSettings(), monitor=None, events=None)
    torch_side = {"logs_specs": agent._logs_specs, "start_method": agent._start_method,
                  "log_line_prefix_template": agent._log_line_prefix_template,
                  "shutdown_timeout": agent._shutdown_timeout}  # what torch's own agent holds
    assert set(torch_side) == set(opts.AGENT_FROM_CONFIG)
    for name, field in opts.AGENT_FROM_CONFIG.items():
        assert torch_side[name] is getattr(config, field), name
    assert agent.shutdown_timeout is config.shutdown_timeout  # the grace for a forwarded stop signal

    params = opts.rendezvous_parameters(config)
    for name, field in opts.RENDEZVOUS_FROM_CONFIG.items():
        assert getattr(params, name) is getattr(config, field), name
    assert params.config["marked_option"] is config.rdzv_configs["marked_option"]


def test_launcher_level_options_are_applied(monkeypatch):
    seen = []
    monkeypatch.setattr(opts.metrics, "initialize_metrics", lambda cfg: seen.append(cfg.params))
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, metrics_cfg={"handler": "console"},
                          signals_to_handle="SIGUSR1,SIGTERM", rdzv_timeout=77)
    opts.prepare_launcher(config)
    assert os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGUSR1,SIGTERM"
    assert seen == [{"handler": "console"}]
    assert opts.rendezvous_parameters(config).config["timeout"] == 77  # rdzv_timeout, through rdzv_configs


# ---- real runs ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for name in ("FAULT_TOL_FINISHED_FLAG_FILE", "NVRX_EVENTS_FILE", "TORCHELASTIC_HEALTH_CHECK_PORT",
                 opts.SHUTDOWN_TIMEOUT_ENV, opts.LAUNCHER_PID_ENV, "CUDA_VISIBLE_DEVICES", "PYTHON_EXEC"):
        env.pop(name, None)
    env.update(extra)
    return env


def start(argv, out_dir, env):
    """A launcher (ft_launcher's command, torchrun, or either through WITH_HEALTH_SERVER), its
    output in out_dir/launcher.out."""
    log = open(os.path.join(out_dir, "launcher.out"), "w")
    try:
        return warm_python.popen(argv, stdout=log, stderr=warm_python.STDOUT, env=env, start_new_session=True,
                                 preload=warm_python.LAUNCHER)
    finally:
        log.close()


def output(out_dir) -> str:
    with open(os.path.join(out_dir, "launcher.out")) as f:
        return f.read()


def finish(proc, out_dir, timeout=180) -> int:
    try:
        return proc.wait(timeout)
    except Exception:
        raise AssertionError(f"the launcher did not finish within {timeout} s:\n{output(out_dir)[-4000:]}")
    finally:
        kill_tree(proc.pid)


def reports(out_dir) -> dict:
    found = {}
    for path in glob.glob(os.path.join(out_dir, "report.rank*.json")):
        with open(path) as f:
            report = json.load(f)
        found[int(report["env"]["RANK"])] = report
    return found


def torch_events(text: str) -> list:
    """The torch.distributed.elastic events an event handler printed (JSON lines)."""
    found = []
    for line in text.splitlines():
        if line.startswith('{"name": "torchelastic'):
            found.append(json.loads(line))
    return found


OPTIONS = ["--nproc-per-node", "2", "--virtual-local-rank", "--tee", "3",  # torch duplicates tee'd streams only
           "--duplicate-stdout-filters", "apple", "--duplicate-stderr-filters", "banana",
           "--event-log-handler", "console"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One job under each launcher with every option above, and a health-check port."""
    done = {}
    for name, launcher_argv in (("warm", ["ft_launcher"]), ("cold", ["ft_launcher", "--no-warm-start"]),
                                ("torchrun", ["torchrun"])):
        out = str(tmp_path_factory.mktemp(name))
        port = free_port()
        env = clean_env(TORCHELASTIC_HEALTH_CHECK_PORT=str(port), HEALTH_SERVER_LOG=os.path.join(out, "health.log"))
        proc = start([WITH_HEALTH_SERVER, *launcher_argv, *OPTIONS, "--log-dir", os.path.join(out, "logs"),
                      JOB, "--out", out], out, env)
        code = finish(proc, out)
        assert code == 0, f"{name}:\n{output(out)[-4000:]}"
        filtered = {}
        for stream in ("stdout", "stderr"):
            [path] = glob.glob(os.path.join(out, "logs", "*", "attempt_0", f"filtered_{stream}.log"))
            with open(path) as f:
                filtered[stream] = sorted(line.split(":", 1)[1] for line in f.read().splitlines())
        with open(os.path.join(out, "health.log")) as f:
            health_log = f.read().splitlines()
        done[name] = SimpleNamespace(pid=proc.pid, port=port, reports=reports(out), filtered=filtered,
                                     health_log=health_log, events=torch_events(output(out)))
    return done


LAUNCHERS = ["warm", "cold", "torchrun"]


@pytest.mark.parametrize("name", LAUNCHERS)
def test_virtual_local_rank_gives_every_worker_local_rank_0_and_its_own_device(runs, name):
    got = runs[name].reports
    assert sorted(got) == [0, 1] and all(r["rank_sum"] == 1 for r in got.values())  # one gloo group of two
    for rank, report in got.items():
        assert report["env"]["LOCAL_RANK"] == "0"
        assert report["env"]["CUDA_VISIBLE_DEVICES"] == str(rank)  # torch: local rank n sees device n only


@pytest.mark.parametrize("name", LAUNCHERS)
def test_duplicate_filters_copy_the_matching_lines_to_the_filtered_files(runs, name):
    assert runs[name].filtered == {"stdout": ["rank 0 apple on stdout", "rank 1 apple on stdout"],
                                   "stderr": ["rank 0 banana on stderr", "rank 1 banana on stderr"]}


def test_event_log_handler_sends_torchs_events_where_it_says_as_under_torchrun(runs):
    def kinds_of(events):
        return sorted((e["name"], e["source"], e["metadata"]["global_rank"]) for e in events)

    reference = kinds_of(runs["torchrun"].events)
    assert ("torchelastic.worker.status.SUCCEEDED", "AGENT", None) in reference
    for name in ("warm", "cold"):
        assert kinds_of(runs[name].events) == reference, name
        [agent] = [e for e in runs[name].events if e["source"] == "AGENT" and e["metadata"]["state"] == "SUCCEEDED"]
        assert agent["metadata"]["rdzv_backend"] == "nvrx"  # recorded by ft_launcher's own agent


@pytest.mark.parametrize("name", LAUNCHERS)
def test_health_check_port_starts_the_server_torchs_agent_would(runs, name):
    run = runs[name]
    assert run.health_log == [f"start {run.port}", f"stop {run.port}"]  # one cycle: up while workers ran
    for report in run.reports.values():
        assert report["health"].startswith("alive ")


def test_every_worker_can_name_its_launcher(runs):
    """torchrun's workers are the launcher's children; a warm-started worker is the fork
    server's, and reads the launcher's pid from $NVRX_LAUNCHER_PID (cold start: both)."""
    assert all(r["ppid"] == runs["torchrun"].pid for r in runs["torchrun"].reports.values())
    for name in ("warm", "cold"):
        run = runs[name]
        assert {r["env"]["NVRX_LAUNCHER_PID"] for r in run.reports.values()} == {str(run.pid)}, name
    assert all(r["ppid"] == runs["cold"].pid for r in runs["cold"].reports.values())
    assert all(r["ppid"] != runs["warm"].pid for r in runs["warm"].reports.values())  # docs/migrating.md


@pytest.mark.parametrize("flag", ["--shutdown-timeout", "--term-timeout"])
def test_a_forwarded_stop_signal_gives_the_workers_the_shutdown_grace_then_kills_them(tmp_path, flag):
    """Workers that ignore SIGTERM: the launcher's grace is the whole stop. --workers-stop-timeout
    (a restart's stop) is 60 s, so only the flag can make it end in seconds."""
    out, events_file = str(tmp_path), str(tmp_path / "events.jsonl")
    proc = start(["-m", "nvrx_core.ft.command", "--nproc-per-node", "2", "--workers-stop-timeout", "60", flag, "2",
                  "--events-file", events_file, JOB, "--out", out, "--hold"], out, clean_env())
    try:
        wait_for(lambda: proc.poll() is not None or len(reports(out)) >= 2, 150, "both workers holding")
        assert proc.poll() is None, output(out)[-4000:]
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = finish(proc, out, timeout=60)
        took = time.monotonic() - began
    finally:
        kill_tree(proc.pid)
    assert code == 128 + signal.SIGTERM, output(out)[-4000:]
    assert 2.0 <= took < 30, took
    [signaled] = kinds(read_events(events_file), "launcher_signaled")
    assert signaled["grace_s"] == 2.0 and set(signaled["exit_codes"].values()) == {-signal.SIGKILL}
    for report in reports(out).values():
        assert report["env"]["LOCAL_RANK"] == report["env"]["RANK"]  # no --virtual-local-rank here


def test_numa_binding_where_it_cannot_bind_fails_before_any_worker_as_under_torchrun(tmp_path, capsys, monkeypatch):
    flags = ["--nproc-per-node", "1", "--numa-binding", "node"]
    out = str(tmp_path / "torchrun")
    os.mkdir(out)
    proc = start(["-m", "torch.distributed.run", *flags, JOB, "--out", out], out, clean_env())
    code, got, text = finish(proc, out), reports(out), output(out)
    if torch.cuda.is_available() and shutil.which("numactl"):  # both bind: the worker runs on the same CPUs
        assert code == 0, text[-3000:]
        ours = str(tmp_path / "ours")
        os.mkdir(ours)
        proc = start(["-m", "nvrx_core.ft.command", *flags, JOB, "--out", ours], ours, clean_env())
        assert finish(proc, ours) == 0, output(ours)[-3000:]
        assert reports(ours)[0]["cpus"] == got[0]["cpus"]
        return
    assert code != 0 and got == {} and "Failed to apply NUMA binding" in text  # torchrun: at the first start
    # ft_launcher: before anything starts (its main, in this process: it starts nothing)
    monkeypatch.delenv("FAULT_TOL_FINISHED_FLAG_FILE", raising=False)
    ours = str(tmp_path / "ours")
    os.mkdir(ours)
    assert launcher.main([*flags, JOB, "--out", ours]) == ExitCode.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "--numa-binding=node" in err and "numactl" in err and reports(ours) == {}


def test_python_exec_names_the_workers_interpreter_so_they_start_cold(tmp_path):
    """torchrun runs the script with $PYTHON_EXEC; a warm start would fork the launcher's own."""
    interpreter = tmp_path / "python-wrapper"
    interpreter.write_text(f'#!/bin/sh\nexport VIA_PYTHON_EXEC=1\nexec {sys.executable} "$@"\n')
    interpreter.chmod(0o755)
    out = str(tmp_path)
    proc = start(["-m", "nvrx_core.ft.command", "--nproc-per-node", "1", JOB, "--out", out, "--env", "VIA_PYTHON_EXEC"],
                 out, clean_env(PYTHON_EXEC=str(interpreter)))
    assert finish(proc, out) == 0, output(out)[-3000:]
    [report] = reports(out).values()
    assert report["env"]["VIA_PYTHON_EXEC"] == "1" and report["ppid"] == proc.pid


# ---- refused before anything starts -------------------------------------------------------------

@pytest.mark.parametrize("flags, env, expected", [
    (["--event-log-handler", "syslog"], {}, "--event-log-handler='syslog'"),
    (["--term-timeout", "5", "--shutdown-timeout", "6"], {}, "conflicts with --shutdown-timeout"),
    (["--term-timeout", "-1"], {}, "--term-timeout=-1.0"),
    (["--shutdown-timeout", "-1"], {}, "--shutdown-timeout=-1"),
    ([], {opts.SHUTDOWN_TIMEOUT_ENV: "soon"}, "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon'"),
    (["--virtual-local-rank"], {"CUDA_VISIBLE_DEVICES": "3"}, "--virtual-local-rank"),
    (["--numa-binding", "socket"], {}, "--numa-binding=socket"),
])
def test_options_this_machine_or_launcher_cannot_honour_are_refused_naming_the_flag(
        tmp_path, capsys, monkeypatch, flags, env, expected):
    if "--numa-binding" in flags and torch.cuda.is_available() and shutil.which("numactl"):
        pytest.skip("this machine can bind workers to NUMA nodes")
    monkeypatch.delenv("FAULT_TOL_FINISHED_FLAG_FILE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w')\n")
    assert launcher.main(["--nproc-per-node", "2", *flags, str(script)]) == ExitCode.CONFIG_ERROR
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "started").exists()


def test_numa_binding_with_virtual_local_rank_needs_a_cold_start(monkeypatch):
    """Where binding works (GPUs and numactl, stood in for here): a warm-started worker binds
    itself after --virtual-local-rank left it one visible GPU, and torch then asks for GPU
    <local rank> among them; a cold start binds through numactl from the launcher, as torchrun."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(opts.shutil, "which", lambda name: f"/usr/bin/{name}")
    args = SimpleNamespace(numa_binding="node", nproc_per_node="2", virtual_local_rank=True)
    with pytest.raises(ConfigError, match="needs --no-warm-start"):
        opts.check_numa_binding(args, warm_start=True)
    opts.check_numa_binding(args, warm_start=False)
    opts.check_numa_binding(SimpleNamespace(numa_binding="node", nproc_per_node="2", virtual_local_rank=False),
                            warm_start=True)


@pytest.mark.parametrize("flags, env, grace", [
    ([], {}, 15.0),  # neither: --workers-stop-timeout, one grace for every stop
    (["--workers-stop-timeout", "40"], {}, 40.0),
    ([], {opts.SHUTDOWN_TIMEOUT_ENV: "25"}, 25.0),  # torchrun's variable
    (["--shutdown-timeout", "7"], {opts.SHUTDOWN_TIMEOUT_ENV: "25"}, 7.0),  # its flag wins, as in torchrun
    (["--term-timeout", "9"], {opts.SHUTDOWN_TIMEOUT_ENV: "25"}, 9.0),
    (["--term_timeout", "9", "--shutdown-timeout", "9"], {}, 9.0),  # the same wait, named twice
    ([], {"PET_TERM_TIMEOUT": "11"}, 11.0),  # nvidia-resiliency-ext's launcher reads it too
])
def test_the_shutdown_grace_comes_from_either_launchers_names(monkeypatch, flags, env, grace):
    for name in ("PET_TERM_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = launcher_args.build_parser().parse_args([*flags, "train.py"])
    assert opts.resolve_shutdown_timeout(args, {k: v for k, v in env.items() if not k.startswith("PET_")}) == grace
