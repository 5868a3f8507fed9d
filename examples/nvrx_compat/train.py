"""A training loop written for nvidia-resiliency-ext 0.4's fault-tolerance API, run on either package.

Only the import lines choose: NVRX_COMPAT_TARGET=nvrx takes nvidia_resiliency_ext's, anything
else (default "ours") nvrx-suite's. The rest is what an NVRx user writes: a FaultToleranceConfig
written to YAML for ft_launcher, a RankMonitorClient sending heartbeats and "setup" / "step" /
"checkpointing" sections, timeouts learned with calculate_and_set_hb_timeouts and
calculate_and_set_section_timeouts and carried from cycle to cycle in the checkpoint through the
client's state_dict.

    python train.py --write-ft-config ft.yaml --out DIR           # the launcher's config
    ft_launcher --nproc-per-node 2 --max-restarts 3 --ft-cfg-path ft.yaml \
        train.py --out DIR [--kill-rank 1 --kill-at 6] [--hang-rank 0 --hang-at 14]

Faults are injected by the script itself, each once per DIR (a marker file records that it
fired), so a restarted job runs on: a killed rank (SIGKILL) and a hung rank (it sleeps inside a
"step" section until the monitor's learned timeout kills it). Each step's data depends only on
(step, rank), so a job resumed from a checkpoint ends with the weights of one never interrupted.
Every rank appends what it loaded and learned to DIR/timeline.jsonl and writes
DIR/result.rank<R>.json at the end (final step, cycle, a hash of its weights).
"""

import os

if os.environ.get("NVRX_COMPAT_TARGET", "ours") == "nvrx":
    from nvidia_resiliency_ext.fault_tolerance import FaultToleranceConfig, RankMonitorClient, RankMonitorClientError
else:
    from nvrx_core.ft import FaultToleranceConfig, RankMonitorClient, RankMonitorClientError

import argparse
import hashlib
import json
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

SECTIONS = {"setup": 120.0, "step": 60.0, "checkpointing": 60.0}


def write_ft_config(path):
    cfg = FaultToleranceConfig.from_kwargs(
        workload_check_interval=1.0,
        initial_rank_heartbeat_timeout=120.0, rank_heartbeat_timeout=60.0,
        rank_section_timeouts=SECTIONS, rank_out_of_section_timeout=60.0,
        safety_factor=50.0,              # learned timeouts: 50 x the longest seen (a loaded CI machine)
        log_level="INFO",
    )
    cfg.to_yaml_file(path)
    assert FaultToleranceConfig.from_yaml_file(path) == cfg, "the config did not survive its YAML file"


def timeouts_record(client):
    hb, sec = client.hb_timeouts, client.section_timeouts
    return {
        "hb": {"initial": hb.initial, "subsequent": hb.subsequent, "were_calculated": hb.were_calculated},
        "sections": dict(sec.section), "out_of_section": sec.out_of_section,
        "calculated_sections": sorted(sec.calculated_sections),
    }


def append(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def fire_once(marker):
    """True the first time in this output directory (the marker survives restarts)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--write-ft-config", metavar="PATH")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--step-time", type=float, default=0.1)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-at", type=int, default=-1)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.write_ft_config:
        write_ft_config(args.write_ft_config)
        return

    dist.init_process_group("gloo")
    rank, cycle = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    ckpt = torch.load(ckpt_path, weights_only=True) if os.path.exists(ckpt_path) else None

    client = RankMonitorClient()
    if ckpt is not None:
        client.load_state_dict(ckpt["ft_state"])   # timeouts learned in an earlier cycle
    client.init_workload_monitoring()
    assert set(client.cfg.rank_section_timeouts) == set(SECTIONS), client.cfg.rank_section_timeouts

    client.start_section("setup")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if ckpt is not None:
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["step"]
    append(os.path.join(args.out, "timeline.jsonl"),
           {"cycle": cycle, "rank": rank, "resumed_from": start, **timeouts_record(client)})

    saves = 0
    for step in range(start + 1, args.steps + 1):
        client.start_section("step")
        if step == start + 1:
            client.end_section("setup")            # the first step belongs to the start
        if rank == args.kill_rank and step == args.kill_at and fire_once(os.path.join(args.out, "killed")):
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == args.hang_rank and step == args.hang_at and fire_once(os.path.join(args.out, "hung")):
            while True:                             # inside 'step': the learned step timeout catches it
                time.sleep(60)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 1000 + rank))
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_time)
        client.end_section("step")
        client.send_heartbeat()

        if step % args.every == 0:
            if saves > 0:                           # every rank here, the same step: a collective is safe
                try:
                    client.calculate_and_set_hb_timeouts()
                    # 'checkpointing' keeps its configured timeout: this save takes milliseconds, and 50 x that
                    # (nvidia-resiliency-ext has no floor) would kill a save on a loaded machine
                    client.calculate_and_set_section_timeouts(selected_sections=["step"],
                                                              calc_out_of_section=False)
                except RankMonitorClientError as e:
                    print(f"rank {rank}: timeouts not learned yet: {e}", flush=True)
                append(os.path.join(args.out, "timeline.jsonl"),
                       {"cycle": cycle, "rank": rank, "learned_at": step, **timeouts_record(client)})
            client.start_section("checkpointing")
            if rank == 0:
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step,
                         "ft_state": client.state_dict()}
                torch.save(state, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            saves += 1
            client.end_section("checkpointing")
            client.send_heartbeat()

    weights = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    result = {"rank": rank, "cycle": cycle, "step": args.steps,
              "weights": hashlib.sha256(weights.numpy().tobytes()).hexdigest()}
    with open(os.path.join(args.out, f"result.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    client.shutdown_workload_monitoring()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
