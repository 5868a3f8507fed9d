"""Copies of node-local shards on peer ranks of other nodes, and moving them back.

Rank r's shard goes to ranks r + j*ranks_per_node (j = 1..k, modulo world size): with
ranks placed node by node, those are k distinct other nodes, so losing one node loses at
most one copy of anyone's shard. Shards travel as raw file bytes plus a JSON file table
over a gloo group; the receiver checks every file's size and checksum before keeping it.
"""

import json
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from nvrx_core import durable
from nvrx_core.collectives import wait_released
from nvrx_core.checkpoint.errors import CheckpointCorruptError, CheckpointError
from nvrx_core.checkpoint.layout import Checksum, FileEntry, Manifest, check_entry, write_manifest
from nvrx_core.checkpoint.shards import byte_view
from nvrx_core.config import check

_HEADER = 4  # generation or step, status, JSON length, data length
_OK, _NOTHING = 1, 0


def check_topology(world_size: int, ranks_per_node: int, replication_factor: int) -> None:
    """Replication needs whole nodes and enough of them to hold k copies elsewhere."""
    check(world_size % ranks_per_node == 0, "ranks_per_node", ranks_per_node,
          f"must divide the world size {world_size} (ranks are placed node by node)")
    nodes = world_size // ranks_per_node
    check(replication_factor <= nodes - 1, "replication_factor", replication_factor,
          f"needs at least {replication_factor + 1} nodes; this job has {nodes} "
          f"({world_size} ranks, {ranks_per_node} per node)")


def replica_targets(rank: int, world_size: int, ranks_per_node: int, factor: int) -> List[int]:
    return [(rank + j * ranks_per_node) % world_size for j in range(1, factor + 1)]


def replica_sources(rank: int, world_size: int, ranks_per_node: int, factor: int) -> List[int]:
    return [(rank - j * ranks_per_node) % world_size for j in range(1, factor + 1)]


class Shipment:
    """A set of files as one byte buffer plus their table (names, sizes, checksums)."""

    def __init__(self, table: dict, data: torch.Tensor):
        self.table = table
        self.data = data

    @classmethod
    def from_files(cls, directory: str, entries: List[FileEntry], meta: dict) -> "Shipment":
        data = torch.empty(sum(e.size for e in entries), dtype=torch.uint8)
        view = byte_view(data)
        offset = 0
        for entry in entries:
            with open(os.path.join(directory, entry.name), "rb", buffering=0) as f:
                got = f.readinto(view[offset:offset + entry.size])
            if got != entry.size:
                raise CheckpointCorruptError(
                    f"{os.path.join(directory, entry.name)}: read {got} of {entry.size} bytes")
            offset += entry.size
        table = dict(meta, files=[[e.name, e.size, e.checksum] for e in entries])
        return cls(table, data)

    def write_to(self, directory: str) -> List[FileEntry]:
        """Write the files into `directory`, checking each against its table entry."""
        checksum_algo = self.table["checksum_algo"]
        os.makedirs(directory, exist_ok=True)
        view = byte_view(self.data)
        offset = 0
        entries = []
        for name, size, checksum in self.table["files"]:
            entry = FileEntry(name, int(size), checksum)
            chunk = view[offset:offset + entry.size]
            digest = Checksum(checksum_algo)
            digest.update(chunk)
            check_entry(f"replica of {name}", entry, len(chunk), digest.value)
            with open(os.path.join(directory, name), "xb") as f:
                f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            entries.append(entry)
            offset += entry.size
        return entries


def exchange(group: dist.ProcessGroup, tag_value: int, outgoing: Optional[Shipment],
             targets: List[int], sources: List[int]) -> Dict[int, Optional[Shipment]]:
    """Send `outgoing` to every target and receive one shipment from every source.

    Every rank of the group calls this for the same `tag_value` (a generation id) in the
    same order; a rank with nothing to send (its save failed) still takes part.
    """
    return transfer(group, tag_value, {t: outgoing for t in targets}, sources)


def transfer(group: dist.ProcessGroup, tag_value: int, sends: Dict[int, Optional[Shipment]],
             receives: List[int]) -> Dict[int, Optional[Shipment]]:
    """Point-to-point shipments: `sends` maps destination rank -> shipment (None: nothing),
    `receives` lists source ranks (ranks within `group`). Two phases (headers, then
    payloads), each posted all at once, so no pair of ranks can deadlock on the other.
    Every tensor handed to torch.distributed is let go of only after it has let go of it
    (collectives.wait_released)."""
    encoded = {dist.get_global_rank(group, dst): _encode(s) for dst, s in sends.items()}
    receives = [dist.get_global_rank(group, src) for src in receives]
    headers_in = {src: torch.zeros(_HEADER, dtype=torch.int64) for src in receives}
    headers_out = {dst: _header(tag_value, header) for dst, (header, _, _) in encoded.items()}
    works = []
    for dst, header in headers_out.items():
        works.append(dist.isend(header, dst, group=group))
    for src, buf in headers_in.items():
        works.append(dist.irecv(buf, src, group=group))
    _wait_all(works, list(headers_out.values()) + list(headers_in.values()))
    handed, incoming = [], {}
    for dst, (header, table, data) in encoded.items():
        if header[0] == _OK:
            works.append(dist.isend(table, dst, group=group))
            handed.append(table)
            if data.numel():
                works.append(dist.isend(data, dst, group=group))
                handed.append(data)
    for src, header in headers_in.items():
        tag, status, table_len, data_len = header.tolist()
        if tag != tag_value:
            raise CheckpointError(
                f"replication out of step: rank {src} sent generation/step {tag}, expected "
                f"{tag_value}; every rank must save and load in the same order")
        if status != _OK:
            incoming[src] = None
            continue
        table = torch.empty(table_len, dtype=torch.uint8)
        data = torch.empty(data_len, dtype=torch.uint8)
        works.append(dist.irecv(table, src, group=group))
        handed.append(table)
        if data_len:
            works.append(dist.irecv(data, src, group=group))
            handed.append(data)
        incoming[src] = (table, data)
    _wait_all(works, handed)
    return {dist.get_group_rank(group, src): None if item is None else
            Shipment(json.loads(bytes(byte_view(item[0]))), item[1]) for src, item in incoming.items()}


def _wait_all(works: list, tensors: List[torch.Tensor]) -> None:
    """Wait for `works`, dropping each (a work object holds its tensors), then for
    torch.distributed to let go of `tensors`."""
    try:
        while works:
            works.pop(0).wait()
    finally:
        works.clear()
    wait_released(tensors)


def _encode(shipment: Optional[Shipment]) -> Tuple[List[int], torch.Tensor, torch.Tensor]:
    if shipment is None:
        empty = torch.empty(0, dtype=torch.uint8)
        return [_NOTHING, 0, 0], empty, empty
    raw = json.dumps(shipment.table, sort_keys=True).encode()
    # a copy: memory owned by torch, not by a Python bytearray (see collectives.wait_released)
    table = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    return [_OK, table.numel(), shipment.data.numel()], table, shipment.data


def _header(tag_value: int, header: List[int]) -> torch.Tensor:
    return torch.tensor([tag_value] + header, dtype=torch.int64)


def write_received(shipment: Shipment, partial_dir: str) -> Manifest:
    """Write a received shard into `partial_dir` with its manifest (not yet committed)."""
    entries = shipment.write_to(partial_dir)
    meta = shipment.table
    manifest = Manifest(step=int(meta["step"]), world_size=int(meta["world_size"]),
                        generation=int(meta["generation"]), run_id=int(meta["run_id"], 16),
                        checksum_algo=meta["checksum_algo"],
                        ranks={int(meta["rank"]): [e.name for e in entries]},
                        files={e.name: e for e in entries})
    write_manifest(partial_dir, manifest)
    durable.fsync_dir(partial_dir)
    return manifest


def plan_restore(inventories: List[dict], bad: set) -> Tuple[Optional[int], Dict[int, int]]:
    """The newest step every rank can get its own shard of, and from whom.

    `inventories[r]` is rank r's {"own": [steps], "held": {src: [steps]}}; `bad` holds
    (holder, src, step) copies found corrupt. Returns (step, {rank: holder}) where holder
    == rank means the rank's own local copy, or (None, {}) if no step is complete.
    """
    own = {r: set(inv["own"]) for r, inv in enumerate(inventories)}
    holders: Dict[Tuple[int, int], List[int]] = {}
    for holder, inv in enumerate(inventories):
        for src, steps in inv["held"].items():
            for step in steps:
                holders.setdefault((int(src), step), []).append(holder)
    candidates = set().union(*own.values(), (step for _, step in holders))
    for step in sorted(candidates, reverse=True):
        plan: Dict[int, int] = {}
        for rank in range(len(inventories)):
            if step in own[rank] and (rank, rank, step) not in bad:
                plan[rank] = rank
                continue
            usable = sorted(h for h in holders.get((rank, step), []) if (h, rank, step) not in bad)
            if not usable:
                break
            plan[rank] = usable[0]
        else:
            return step, plan
    return None, {}
