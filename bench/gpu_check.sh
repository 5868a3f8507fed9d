#!/usr/bin/env bash
# GPU-side checks of health checks and in-process restart, on a machine with an NVIDIA GPU.
#
#   bash bench/gpu_check.sh [PYTHON]      # PYTHON: an interpreter with CUDA torch (default: python3)
#
# Needs torch built with CUDA and nvidia-ml-py (pip install 'nvrx-suite[gpu]'); run from the
# repository root. It checks, on GPU 0:
#   1. NVML health checks run for real (not "not applicable") and report the GPU healthy;
#      NVLink state of every link (not applicable on a GPU without NVLink); CUDA synchronize;
#   2. an NCCL process group: abort + destroy + re-create in the same process, timed;
#   3. the Wrapper with NCCL (1 rank, one GPU): an exception in iteration 0, recovery in
#      iteration 1, timed from the fault to the first all-reduce after it.
# Exit code 0: all passed; 1: a check failed; 2: the machine/environment cannot run it.
set -euo pipefail
PYTHON=${1:-python3}
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "(nvidia-smi not found)"

PYTHONPATH=. OMP_NUM_THREADS=1 "$PYTHON" - <<'EOF'
import datetime, os, socket, sys, time

import torch
import torch.distributed as dist

if torch.version.cuda is None or not torch.cuda.is_available():
    print(f"cannot run: torch {torch.__version__} has CUDA={torch.version.cuda}, "
          f"available={torch.version.cuda is not None and torch.cuda.is_available()}; use a CUDA build on a GPU machine")
    sys.exit(2)
try:
    import pynvml  # noqa: F401
except ImportError:
    print("cannot run: nvidia-ml-py is missing (pip install 'nvrx-suite[gpu]')")
    sys.exit(2)

from nvrx_core.health import CudaHealthCheck, GPUHealthCheck, NVLHealthCheck, Status, check_device
from nvrx_core.inprocess import RestartState, Wrapper
from nvrx_core.inprocess.abort import AbortProcessGroups, IterationConnections

failures = []
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")

# 1. health checks, for real
began = time.perf_counter()
gpu = GPUHealthCheck()()
first = time.perf_counter() - began
began = time.perf_counter()
GPUHealthCheck()()
again = time.perf_counter() - began
for result in (gpu, NVLHealthCheck()(), CudaHealthCheck(timeout=30)(), check_device(0)):
    print(f"  {result.check:8s} {result.status.value:15s} {result.detail}")
print(f"  GPU check: first call {first * 1000:.1f} ms (NVML init), then {again * 1000:.1f} ms")
if gpu.status != Status.HEALTHY:
    failures.append(f"GPUHealthCheck: {gpu.status.value} ({gpu.detail})")
if CudaHealthCheck()().status != Status.HEALTHY:
    failures.append("CudaHealthCheck is not healthy")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# 2. NCCL: abort, destroy and re-create inside the process
store = dist.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
device = torch.device("cuda", 0)
connections = IterationConnections(protected_local_port=store.port)
connections.begin()  # sockets opened from here on belong to the group being aborted
began = time.perf_counter()
dist.init_process_group("nccl", store=dist.PrefixStore("first", store), rank=0, world_size=1, device_id=device)
x = torch.ones(1 << 20, device=device)
dist.all_reduce(x)
torch.cuda.synchronize()
print(f"  NCCL group created + first all-reduce: {time.perf_counter() - began:.3f} s")
abort = AbortProcessGroups(connections)
began = time.perf_counter()
abort.abort_communication()
abort.destroy()
abort.release()
dist.init_process_group("nccl", store=dist.PrefixStore("second", store), rank=0, world_size=1, device_id=device)
dist.all_reduce(x)
torch.cuda.synchronize()
print(f"  NCCL abort + destroy + re-create + all-reduce: {time.perf_counter() - began:.3f} s")
dist.destroy_process_group()

# 3. the Wrapper on NCCL: fault in iteration 0, recovery in iteration 1
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", NVRX_INPROCESS_STORE=f"127.0.0.1:{store.port}")
marks = {}


@Wrapper(soft_timeout=30, hard_timeout=60, barrier_timeout=120, monitor_interval=0.5)
def train(state: RestartState):
    state.init_process_group("nccl", device_id=device)
    y = torch.ones(1 << 20, device=device)
    dist.all_reduce(y)
    torch.cuda.synchronize()
    if state.iteration == 0:
        marks["fault"] = time.perf_counter()
        raise RuntimeError("injected exception")
    marks["recovered"] = time.perf_counter()
    dist.destroy_process_group()
    return state.iteration


iteration = train()
if iteration != 1:
    failures.append(f"Wrapper on NCCL ended in iteration {iteration}, expected 1")
else:
    print(f"  Wrapper on NCCL: fault -> first all-reduce after recovery {marks['recovered'] - marks['fault']:.3f} s")

print("gpu_check:", "PASSED" if not failures else "FAILED: " + "; ".join(failures))
sys.exit(1 if failures else 0)
EOF
