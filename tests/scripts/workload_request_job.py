"""Two gloo ranks under ft_launcher; rank 1 asks for a workload action (argv[1], an
nvidia-resiliency-ext WorkloadAction name) and then fails, as FaultToleranceSectionsCallback's
exc_handling_policy does; rank 0 waits in a collective until the launcher stops it."""
import sys

import torch.distributed as dist

from nvrx_core.ft import RankMonitorClient, WorkloadAction, WorkloadControlRequest

client = RankMonitorClient()
client.init_workload_monitoring()
dist.init_process_group("gloo")
client.send_heartbeat()
if dist.get_rank() == 1:
    client.send_workload_control_request(WorkloadControlRequest(WorkloadAction[sys.argv[1]], "bad data shard"))
    raise RuntimeError("a failure after the request")
dist.barrier()
