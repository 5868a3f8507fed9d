"""What the benchmark jobs (_toy_job.py, _slurm_job.py) share: their timeline, their heartbeat
client and their model. Torch only, so it imports under every launcher's python (ours, torchrun,
nvidia-resiliency-ext's venv); a job finds it beside itself (the script's folder is sys.path[0])."""
import json
import os
import time

import torch


def recorder(timeline):
    """A function appending one JSON line {"t", "ev", "pid", ...} to `timeline`, synced at once:
    the benchmark reads fault and step times there, even of a rank killed right after."""
    def record(ev, **fields):
        line = json.dumps({"t": time.time(), "ev": ev, "pid": os.getpid(), **fields}) + "\n"
        fd = os.open(timeline, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    return record


def heartbeat_client(kind):
    """The rank monitor client of "ours" or "nvrx" (nvidia-resiliency-ext), monitoring started;
    None for "none" (torchrun, no monitor)."""
    if kind == "none":
        return None
    if kind == "ours":
        from nvrx_core.ft.client import RankMonitorClient
    else:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    client = RankMonitorClient()
    client.init_workload_monitoring()
    return client


def model_from(ckpt):
    """The jobs' model and optimizer, and the step to start from: the checkpoint's, if there is one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        start = state["step"]
    return model, opt, start
