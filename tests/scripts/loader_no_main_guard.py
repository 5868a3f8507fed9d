# A torchrun-style training script with top-level code and no `if __name__ == "__main__":`
# guard, iterating a DataLoader with persistent worker processes. Many real scripts look
# like this; it must run under ft_launcher exactly as under torchrun.
#
# argv: OUT_DIR [KILL_AT]. Rank 1 SIGKILLs itself in cycle 0 at global step KILL_AT (after
# its DataLoader workers exist). Each rank writes OUT_DIR/rank{R}.cycle{C}.json: what it saw
# of multiprocessing, its descendants (pid, start time), and which processes recorded by
# earlier cycles were still alive when it started.
import json
import multiprocessing
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from nvrx_core.ft.process_groups import descendants


def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


out_dir = sys.argv[1]
kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1
rank = int(os.environ["RANK"])
cycle = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

survivors = []
for name in os.listdir(out_dir):
    if name.endswith(".json"):
        with open(os.path.join(out_dir, name)) as f:
            for pid, started in json.load(f)["descendants"]:
                if start_time(pid) == started:
                    survivors.append(pid)

dist.init_process_group("gloo")
loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=4, num_workers=2, persistent_workers=True)
report = {
    "start_method": multiprocessing.get_start_method(),
    "process_name": multiprocessing.current_process().name,
    "own_process_group": os.getpgrp() == os.getpid(),
    "survivors_of_earlier_cycles": survivors,
}
total = torch.zeros(1)
step = 0
for epoch in range(2):
    for (x,) in loader:
        if step == 0:
            report["descendants"] = [(pid, start_time(pid)) for pid in sorted(descendants(os.getpid()))]
            with open(os.path.join(out_dir, f"rank{rank}.cycle{cycle}.json"), "w") as f:
                json.dump(report, f)
        s = x.sum().reshape(1)
        dist.all_reduce(s)
        total += s
        step += 1
        if cycle == 0 and rank == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

report["total"] = total.item()
with open(os.path.join(out_dir, f"rank{rank}.cycle{cycle}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
