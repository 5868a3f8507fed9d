"""Node-local checkpoints: frequent saves to fast local storage, replicated to peer nodes.

    local = LocalCheckpointManager("/dev/shm/ckpt", LocalCheckpointConfig(replication_factor=1))
    persistent = AsyncCheckpointer("/lustre/run1/ckpt")
    loaded = local.load(fallback=persistent.load_latest)   # local -> replica -> persistent
    ...
    local.save(state, step); local.finalize()

    <root_dir>/rank_00003/step_0000000200/          rank 3's own shard (+ manifest)
    <root_dir>/replicas/rank_00001/step_0000000200/ a copy of rank 1's shard, held here

Each rank commits its own local checkpoints independently (no collective on save), so
ranks may briefly differ in what they have; find_latest() and load() agree, across all
ranks, on the newest step every rank can obtain - from its own disk or a peer's replica.
Construction, find_latest() and load() are collective; save/finalize are per rank,
except that with replication every rank's background worker exchanges each save's shard
with its peers, so every rank must call save() the same number of times.
"""

import dataclasses
import datetime
import logging
import os
import random
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

from nvrx_core import collectives, dist_env
from nvrx_core.checkpoint import replication
from nvrx_core.checkpoint.agreed_load import load_everywhere
from nvrx_core.checkpoint.collectives import side_group
from nvrx_core.checkpoint.config import LocalCheckpointConfig
from nvrx_core.checkpoint.errors import (CheckpointCorruptError, CheckpointError,
                                         CheckpointNotFoundError)
from nvrx_core.checkpoint.layout import (CheckpointStore, FileEntry, Manifest, check_sizes,
                                         partial_dir_name, rank_prefix, read_manifest,
                                         write_manifest)
from nvrx_core.checkpoint.pipeline import PendingSave
from nvrx_core.checkpoint.pipelined import PipelinedSaves
from nvrx_core.checkpoint.shards import SaveAborted, read_shard
from nvrx_core.config import ConfigError
from nvrx_core.events import CHECKPOINT_COMMITTED, CHECKPOINT_LOADED, EventLog

logger = logging.getLogger("nvrx.checkpoint")

LOCAL, REPLICA, GLOBAL = "local", "replica", "global"


@dataclasses.dataclass
class LoadedCheckpoint:
    step: int
    state: Any
    source: str
    """Where this rank's shard came from: "local", "replica" or "global"."""


class LocalCheckpointManager:
    """Per-rank checkpoints on node-local storage with optional peer replication."""

    def __init__(self, root_dir: Optional[str] = None, config: Optional[LocalCheckpointConfig] = None,
                 *, process_group: Any = None, events: Optional[EventLog] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config or LocalCheckpointConfig()
        self.root_dir = os.path.abspath(root_dir or self.config.root_dir)
        self._group = collectives.resolve_group(process_group)
        self.rank, self.world_size = collectives.group_rank_size(self._group)
        self._writer_config = self.config.writer_config()
        self._events = events if events is not None else EventLog.from_env("checkpoint")
        self.store = CheckpointStore(os.path.join(self.root_dir, rank_prefix(self.rank)))
        self.targets: List[int] = []
        self.sources: List[int] = []
        self._exchange_group: Optional[dist.ProcessGroup] = None
        if self.config.replication_factor:
            self._setup_replication()
        self._saves = PipelinedSaves(self._writer_config, self.rank, settle=self._settle,
                                     events=self._events, clock=clock,
                                     noun="local checkpoint", event_fields={"tier": LOCAL})
        self._run_id = random.SystemRandom().getrandbits(63)
        for store in [self.store] + [self._replica_store(s) for s in self.sources]:
            store.remove_leftovers(self._run_id)

    def _setup_replication(self) -> None:
        if self._group is collectives.SINGLE_PROCESS:
            raise ConfigError("replication_factor>0 needs torch.distributed to be initialized")
        per_node = self.config.ranks_per_node or dist_env.local_world_size(optional=True)
        if not per_node:
            raise ConfigError("replication_factor>0: set ranks_per_node or LOCAL_WORLD_SIZE so "
                              "replicas can be placed on other nodes")
        replication.check_topology(self.world_size, per_node, self.config.replication_factor)
        self.targets = replication.replica_targets(self.rank, self.world_size, per_node,
                                                   self.config.replication_factor)
        self.sources = replication.replica_sources(self.rank, self.world_size, per_node,
                                                   self.config.replication_factor)
        # A group of its own: the background worker uses it while training uses the main one.
        self._exchange_group = side_group(
            self._group, datetime.timedelta(seconds=self.config.replication_timeout_s))

    def _replica_store(self, src: int) -> CheckpointStore:
        return CheckpointStore(os.path.join(self.root_dir, "replicas", rank_prefix(src)))

    # ---- saving ----------------------------------------------------------------------------

    def save(self, state_dict: Any, step: int) -> int:
        """Stage `state_dict`; this rank's shard (and replicas) are written in the background."""
        pending = self._saves.start(
            state_dict, step,
            lambda gen: os.path.join(self.store.root_dir, partial_dir_name(step, self._run_id, gen)))
        return pending.generation

    def finalize(self, blocking: bool = False) -> List[int]:
        """Steps this rank committed locally since the last call; raises failed saves."""
        return self._saves.finalize(blocking)

    def abort(self, timeout: Optional[float] = None) -> List[int]:
        """Stop this rank's saves in flight and delete their partial output; their steps."""
        return self._saves.abort(timeout)

    def close(self) -> None:
        """Wait for the saves in flight, then stop the background threads (again: nothing)."""
        self._saves.close()

    def _settle(self, pending: PendingSave, entries: Optional[List[FileEntry]],
                error: Optional[BaseException]) -> None:
        """Worker side: exchange replicas (always, to stay in step with the peers), then
        commit this rank's shard and the replicas it received."""
        received: Dict[int, str] = {}
        if self._exchange_group is not None:
            outgoing = None
            if entries is not None and not pending.cancel.is_set():
                try:
                    outgoing = self._shipment(pending, entries)
                except Exception as e:  # still take part in the exchange, sending nothing
                    error, entries = e, None
            received = self._replicate(pending, outgoing)
        try:
            if error is not None:
                raise error
            if pending.cancel.is_set():
                raise SaveAborted(f"local save of step {pending.step} aborted")
            self._commit(pending, entries, received)
            received = {}
        finally:
            for partial in received.values():   # not committed: leave nothing behind
                shutil.rmtree(partial, ignore_errors=True)

    def _commit(self, pending: PendingSave, entries: List[FileEntry], received: Dict[int, str]) -> None:
        write_manifest(pending.directory, Manifest(
            step=pending.step, world_size=self.world_size, generation=pending.generation,
            run_id=self._run_id, checksum_algo=self._writer_config.checksum,
            ranks={self.rank: [e.name for e in entries]}, files={e.name: e for e in entries}))
        path = self.store.commit(pending.directory, pending.step)
        self.store.apply_retention(self.config.keep_last)
        for src, partial in received.items():
            store = self._replica_store(src)
            store.commit(partial, pending.step)
            store.apply_retention(self.config.keep_last)
        if self.rank == 0:
            self._events.emit(CHECKPOINT_COMMITTED, step=pending.step, path=path, tier=LOCAL,
                              generation=pending.generation, bytes=pending.staged_bytes,
                              blocking_s=round(pending.blocking_seconds, 4))

    def _shipment(self, pending: PendingSave, entries: List[FileEntry]) -> replication.Shipment:
        return replication.Shipment.from_files(pending.directory, entries, {
            "rank": self.rank, "step": pending.step, "generation": pending.generation,
            "world_size": self.world_size, "run_id": f"{self._run_id:016x}",
            "checksum_algo": self._writer_config.checksum})

    def _replicate(self, pending: PendingSave,
                   outgoing: Optional[replication.Shipment]) -> Dict[int, str]:
        """Send this rank's shard to its targets, write the sources' shards (uncommitted)."""
        received = replication.exchange(self._exchange_group, pending.generation, outgoing,
                                        self.targets, self.sources)
        written: Dict[int, str] = {}
        try:
            for src, shipment in received.items():
                if shipment is None:
                    logger.warning("rank %d sent no replica for step %d", src, pending.step)
                    continue
                if int(shipment.table["step"]) != pending.step:
                    raise CheckpointError(f"rank {src} sent a replica of step "
                                          f"{shipment.table['step']} during step {pending.step}")
                partial = os.path.join(self._replica_store(src).root_dir,
                                       partial_dir_name(pending.step, self._run_id, pending.generation))
                written[src] = partial
                replication.write_received(shipment, partial)
        except BaseException:
            for partial in written.values():
                shutil.rmtree(partial, ignore_errors=True)
            raise
        return written

    # ---- finding and loading ---------------------------------------------------------------

    def find_latest(self) -> Optional[int]:
        """The newest step every rank can obtain (own copy or a peer's replica), agreed by all."""
        inventories = collectives.all_gather_json(self._inventory([]), self._group)
        return replication.plan_restore(inventories, _bad_copies(inventories))[0]

    def load(self, fallback: Optional[Callable[[], Tuple[int, Any]]] = None, *,
             weights_only: bool = True) -> LoadedCheckpoint:
        """Load the newest complete local checkpoint, falling back local -> replica -> `fallback`.

        A corrupt copy (size or checksum mismatch) is skipped in favour of another copy of
        the same step, then of an older step. `fallback` (e.g. AsyncCheckpointer.load_latest)
        is used when no step is complete across ranks; without it, CheckpointNotFoundError.
        """
        if self._saves.pipeline.pending:
            raise CheckpointError("load() while saves are in flight: call finalize(blocking=True)")
        bad: List[List[int]] = []
        while True:
            inventories = collectives.all_gather_json(self._inventory(bad), self._group)
            step, plan = replication.plan_restore(inventories, _bad_copies(inventories))
            if step is None:
                break
            attempt = load_everywhere(lambda: self._restore_and_read(step, plan, weights_only),
                                      self._group, f"local step {step}")
            if attempt.corrupt is not None:
                logger.warning("local checkpoint step %d unusable on rank %d: %s", step, self.rank,
                               attempt.corrupt)
                bad.append([plan[self.rank], self.rank, step])
            if attempt.everywhere:
                source = LOCAL if plan[self.rank] == self.rank else REPLICA
                self._events.emit(CHECKPOINT_LOADED, step=step, source=source, tier=LOCAL)
                return LoadedCheckpoint(step, attempt.state, source)
        if fallback is None:
            raise CheckpointNotFoundError(
                f"no local checkpoint is complete across ranks under {self.root_dir}")
        step, state = fallback()
        self._events.emit(CHECKPOINT_LOADED, step=step, source=GLOBAL)
        return LoadedCheckpoint(step, state, GLOBAL)

    def _inventory(self, bad: List[List[int]]) -> dict:
        held = {str(src): self._valid_steps(self._replica_store(src), src) for src in self.sources}
        return {"own": self._valid_steps(self.store, self.rank), "held": held, "bad": bad}

    def _valid_steps(self, store: CheckpointStore, src: int) -> List[int]:
        """Steps whose manifest reads and whose files have the listed sizes (cheap check;
        checksums are verified when the shard is read)."""
        valid = []
        for step in store.steps():
            try:
                manifest = read_manifest(store.path(step))
                if src not in manifest.ranks:
                    raise CheckpointCorruptError(f"{store.path(step)}: no files of rank {src}")
                check_sizes(store.path(step), manifest, manifest.ranks[src])
            except CheckpointCorruptError as e:
                logger.warning("ignoring local checkpoint %s: %s", store.path(step), e)
                continue
            valid.append(step)
        return valid

    def _restore_and_read(self, step: int, plan: Dict[int, int], weights_only: bool) -> Any:
        """This rank's state of `step`, its shard first fetched from a replica if the plan says so."""
        self._restore_from_replicas(step, plan)
        return self._read_own(step, weights_only)

    def _read_own(self, step: int, weights_only: bool) -> Any:
        manifest = read_manifest(self.store.path(step))
        entries = {n: manifest.files[n] for n in manifest.ranks.get(self.rank, [])}
        return read_shard(self.store.path(step), self.rank, entries, manifest.checksum_algo,
                          weights_only=weights_only)

    def _restore_from_replicas(self, step: int, plan: Dict[int, int]) -> None:
        """Ship the replicas the plan calls for; a receiving rank commits what it gets as its
        own local checkpoint (so the lost node's directory is rebuilt)."""
        moves = {rank: holder for rank, holder in plan.items() if holder != rank}
        if not moves:
            return
        sends = {rank: self._replica_shipment(rank, step)
                 for rank, holder in moves.items() if holder == self.rank}
        receives = [holder for rank, holder in moves.items() if rank == self.rank]
        received = replication.transfer(self._exchange_group, step, sends, receives)
        for holder, shipment in received.items():
            if shipment is None:
                raise CheckpointCorruptError(f"rank {holder} could not read its replica of rank "
                                             f"{self.rank} step {step}")
            partial = os.path.join(self.store.root_dir, partial_dir_name(step, self._run_id, 0))
            shutil.rmtree(partial, ignore_errors=True)
            try:
                replication.write_received(shipment, partial)
            except CheckpointCorruptError:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            self.store.commit(partial, step)
            logger.info("rank %d restored local step %d from rank %d's replica",
                        self.rank, step, holder)

    def _replica_shipment(self, src: int, step: int) -> Optional[replication.Shipment]:
        directory = self._replica_store(src).path(step)
        try:
            manifest = read_manifest(directory)
            entries = [manifest.files[n] for n in manifest.ranks[src]]
            return replication.Shipment.from_files(directory, entries, {
                "rank": src, "step": step, "generation": manifest.generation,
                "world_size": manifest.world_size, "run_id": f"{manifest.run_id:016x}",
                "checksum_algo": manifest.checksum_algo})
        except (CheckpointCorruptError, KeyError, OSError) as e:
            logger.warning("cannot ship replica of rank %d step %d: %s", src, step, e)
            return None


def _bad_copies(inventories: List[dict]) -> set:
    return {tuple(item) for inv in inventories for item in inv["bad"]}
