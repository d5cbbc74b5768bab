"""What a manager does once at construction: join the job (its process groups, one agreed
exchange in which every rank prepares its node's root and shows its settings), and check that
the replication strategy protects against a node loss on the topology the exchange revealed
(pure).
"""

from __future__ import annotations

import logging
import os
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replication import (
    CliqueReplicationStrategy,
    ErasureCodingStrategy,
    NodeSpreadReplicationStrategy,
    NoReplication,
    Placement,
    ReplicationStrategy,
    StripeLayout,
    Topology,
    TopologyError,
    local_node_name,
    owners_without_remote_copy,
)

from ..errors import ConfigurationError, SessionInUseError
from ..ops.metrics import Metrics
from ..storage.durable import DurableStore
from ..storage.fsutil import check_safe_dir, make_private_dir, make_private_dirs
from ..storage.io_sizing import cpu_set, default_io_threads, ranks_sharing
from ..storage.layout import MAX_WORLD_SIZE, find_leftovers, remove_paths, session_dir
from ..storage.session_lock import SessionLock
from ..storage.store import ShardStore
from .collectives import CheckpointGroup
from .context import Context
from .durable_config import DurableTier
from .settings import refuse_differing

logger = logging.getLogger(__name__)


@dataclass
class Joined:
    """This rank's place in the job, as the start-up exchange settled it: its context (groups,
    topology, placement, store), its shared lock on the session, its durable tier (None: none
    given), the job run's id (rank 0's) and the job identity every manifest records."""

    ctx: Context
    lock: SessionLock
    tier: DurableStore | None
    run: str
    identity: dict[str, Any]


def join_job(root: Path, session_id: str, node_id: str | None, *, timeout: float,
             strategy: ReplicationStrategy | None, strict: bool, settings: dict[str, Any],
             metrics: Metrics, allow_unsafe_root: bool, recycle_files: bool,
             durable: DurableTier | None, io_threads: int | None, chunk_nbytes: int,
             undo: list[Callable[[], object]]) -> Joined:
    """Create the manager's two gloo groups (control, and data for shard transfers that may
    run in the background), then run one agreed exchange in which every rank prepares its node
    root (:func:`open_node_root`), opens its durable tier and shows its ``settings``; place
    replicas and stripes on the topology revealed. Collective. Whatever it takes is appended to
    ``undo`` (the caller releases it in reverse if construction fails later). Raises on every
    rank alike: ConfigurationError (a world too large, settings that differ, a strategy that
    cannot protect this topology with ``strict``), SessionInUseError, CollectiveError."""
    group = CheckpointGroup(timeout)  # control: agreement, training thread only
    undo.append(group.close)
    data_group = CheckpointGroup(timeout)  # shard transfers, maybe in the background
    undo.append(data_group.close)
    rank, world_size = group.rank, group.world_size
    locks: list[SessionLock] = []
    tiers: list[DurableStore] = []

    def start() -> dict[str, Any]:
        if world_size > MAX_WORLD_SIZE:
            raise ConfigurationError(f"world size: expected at most {MAX_WORLD_SIZE} ranks "
                                     f"(5 digits in shard names), got {world_size}")
        # Well under the timeout: the other ranks wait that long for this exchange, and
        # should get SessionInUseError from here, not a timeout of their own.
        doc, lock = open_node_root(root, session_id, node_id, allow_unsafe_root,
                                   min(timeout / 3, 30.0), recycle_files)
        locks.append(lock)
        undo.append(lock.release)
        if durable is not None:  # settings a rank cannot use fail every rank here alike
            durable.check_apart(root, session_id)
            tiers.append(DurableStore(durable.root, session_id, rank,
                                      io_threads=io_threads or 4, timeout=timeout,
                                      options=durable.options))
            undo.append(tiers[0].close)
        return {**doc, "cpus": cpu_set(), "run": uuid.uuid4().hex, "settings": settings}

    started = group.exchange("start", start)
    refuse_differing([d["settings"] for d in started])  # every rank alike
    names = [str(d["node"]) for d in started]
    topology = Topology(tuple(names))
    placement = place_replicas(strategy, topology,
                               [(int(d["root"][0]), int(d["root"][1])) for d in started],
                               strict, rank)
    layout = stripes(strategy, topology, strict, rank)
    if io_threads is None:  # this rank's share of the cores it may run on
        io_threads = default_io_threads(ranks_sharing(rank, names,
                                                      [d.get("cpus") for d in started]))
    store = ShardStore(root, session_id, writer_rank=rank, io_threads=io_threads,
                       chunk_nbytes=chunk_nbytes, recycle=recycle_files)
    undo.append(store.close)
    group.use_nodes(topology.node_of)
    data_group.use_nodes(topology.node_of)
    # Recorded in every manifest; a shard written under another layout is warned about.
    identity = {"world_size": world_size, "nodes": topology.num_nodes,
                "topology_crc32": zlib.crc32("\n".join(names).encode())}
    ctx = Context(rank, world_size, session_id, root, timeout, group, data_group, topology,
                  placement, store, metrics, identity, erasure=layout)
    return Joined(ctx, locks[0], tiers[0] if tiers else None,
                  str(started[0]["run"]), identity)  # the run's id: rank 0's


def open_node_root(root: Path, session_id: str, node_id: str | None, allow_unsafe: bool,
                   lock_wait: float, recycle: bool = False
                   ) -> tuple[dict[str, Any], SessionLock]:
    """This rank's part of the start exchange: create the root and the session directory (0700,
    durable), refuse them if unsafe (see :func:`localckpt.storage.fsutil.check_safe_dir`), take
    the session's shared lock, and remove every writer's crash leftovers (the pool of recycled
    chunk files too, unless this job ``recycle``s: its first save then writes over them).
    Returns what the other ranks need to know (node name, identity of the root) and the lock.

    Removing any writer's leftovers is safe only here, and only alone: no rank of this job
    writes before this exchange completes, ranks move between nodes when a node is replaced (a
    leftover's writer may now live elsewhere), but another live process of the session (an
    evaluation job loading the latest) may be writing now.
    """
    try:
        make_private_dirs(root)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ConfigurationError(
            f"root_local_ckpt_dir: expected a directory, got {root} ({exc.strerror})") from exc
    check_safe_dir(root, "root_local_ckpt_dir", allow_unsafe)
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigurationError(f"root_local_ckpt_dir: {root} is not writable by this process")
    session = session_dir(root, session_id)
    make_private_dir(session)
    check_safe_dir(session, "session directory", allow_unsafe)
    try:  # alone in the session on this node: no other process can be writing in it
        lock = SessionLock(session, exclusive=True)
    except SessionInUseError:  # a live manager (node mate, another job) or gc: its writes stay
        lock = SessionLock(session, exclusive=False, wait=lock_wait)
        logger.info("%s is in use by another process: crash leftovers are left to a start "
                    "alone in it, or to localckpt gc", session)
    else:
        # Listed alone, removed once shared: node mates waiting to start are not held up by
        # the rmtree of a large crashed save (no one else can own what was listed).
        leftovers = find_leftovers(session, None, keep_recycled=recycle)
        lock.share(lock_wait)
        try:
            remove_paths(session, leftovers)
        except BaseException:
            lock.release()
            raise
    try:
        st = os.stat(root)
    except BaseException:
        lock.release()
        raise
    return {"node": local_node_name(node_id), "root": [st.st_dev, st.st_ino]}, lock


def shared_roots_hint(topology: Topology, roots: list[tuple[int, int]]) -> str:
    """A hint when ranks the topology puts on one node use different roots: localckpt assumes
    node mates share their root (it plans replicas per node), so they would get none."""
    by_node: dict[int, set[tuple[int, int]]] = defaultdict(set)
    for rank, r in enumerate(roots):
        by_node[topology.node_of[rank]].add(r)
    split = [n for n, rs in by_node.items() if len(rs) > 1]
    if not split:
        return ""
    node = split[0]
    members = topology.nodes[node]
    return (f"ranks {list(members)} report node {topology.node_names[members[0]]!r} "
            f"but use {len(by_node[node])} different roots; localckpt treats ranks of one node "
            "as sharing one root. Set LOCALCKPT_NODE_ID (or node_id=) per node so that nodes are "
            "told apart, or give node mates one root")


def place_replicas(strategy: ReplicationStrategy | None, topology: Topology,
                   roots: list[tuple[int, int]], strict: bool, rank: int) -> Placement:
    """The placement of ``strategy`` (no holders without one). Pure: every rank reaches the same
    result. A strategy that leaves shards without a copy on another node is reported loudly
    (rank 0 logs a warning) or, with ``strict``, raises ConfigurationError on every rank. So is
    one whose replication factor needs more nodes than the job has (one machine, a job shrunk
    to fewer nodes): without ``strict`` each shard then gets a copy on every other node (none on
    a single node), placed as node_spread places them. So are node names the roots contradict
    (ranks reporting one node with different roots: a copy on another node name may share its
    owner's machine), with replicas or erasure stripes."""
    hint = shared_roots_hint(topology, roots)

    def names_untrusted() -> None:
        # The names say the copies are on other nodes; the roots say the names are wrong (a
        # stale LOCALCKPT_NODE_ID): a copy may share its owner's machine.
        if hint:
            message = (f"replication {strategy!r}: node names cannot place copies on other "
                       f"machines: {hint}")
            if strict:
                raise ConfigurationError(f"{message}; strict=True refuses that")
            if rank == 0:
                logger.warning(message)

    if strategy is None or isinstance(strategy, NoReplication):
        return NoReplication().place(topology)
    if isinstance(strategy, ErasureCodingStrategy):
        names_untrusted()
        return NoReplication().place(topology)  # parity instead of replicas: see stripes
    factor = getattr(strategy, "replication_factor", 0)
    nodes = topology.num_nodes
    if factor > 1 and nodes < factor and not hint:
        message = (f"replication {strategy!r}: replication_factor {factor} needs {factor} "
                   f"nodes, the job has {nodes}: each shard gets {nodes - 1} copies on other "
                   "nodes instead" + (" (none: on one node, losing it loses every shard)"
                                      if nodes == 1 else ""))
        if strict:
            raise ConfigurationError(f"{message}; strict=True refuses that")
        if rank == 0:
            logger.warning(message)
        return (NodeSpreadReplicationStrategy(nodes).place(topology) if nodes > 1
                else NoReplication().place(topology))
    try:
        placement = strategy.place(topology)
    except TopologyError as exc:
        raise TopologyError(f"{exc}; {hint}" if hint else str(exc)) from None
    uncovered = owners_without_remote_copy(placement, topology)
    if not uncovered:
        names_untrusted()
        return placement
    if not hint:
        per_node = {len(members) for members in topology.nodes}
        if topology.num_nodes == 1:
            hint = ("every rank is on one node (by hostname or LOCALCKPT_NODE_ID): a copy on "
                    "another node needs at least 2 nodes")
        elif isinstance(strategy, CliqueReplicationStrategy) and len(per_node) == 1:
            hint = (f"clique groups ranks m, m+J, m+2J, ... with replication_jump J="
                    f"{strategy.replication_jump}; set replication_jump={per_node.pop()} (the "
                    "ranks per node) or use repl_strategy='node_spread'")
        else:
            hint = "use repl_strategy='node_spread', which places replicas on other nodes"
    message = (f"replication {strategy!r}: {len(uncovered)} of {topology.world_size} shards have "
               f"no copy on another node, so losing a node loses them: {hint}")
    if strict:
        raise ConfigurationError(message)
    if rank == 0:
        logger.warning(message)
    return placement


def stripes(strategy: ReplicationStrategy | None, topology: Topology, strict: bool,
            rank: int) -> StripeLayout | None:
    """The erasure-coded stripes of ``strategy`` on ``topology`` (None for any other strategy).
    With fewer nodes than a stripe's k + m blocks need, a warning (rank 0) and no parity, as
    replication degrades on too few nodes, or with ``strict`` ConfigurationError on every rank
    (pure: every rank decides alike)."""
    if not isinstance(strategy, ErasureCodingStrategy):
        return None
    try:
        return strategy.stripes(topology)
    except TopologyError as exc:
        message = (f"replication {strategy!r}: {exc}; saves get no parity, so losing a node "
                   "loses its shards, and parity blocks already on disk (saved on another "
                   "topology) rebuild nothing")
        if strict:
            raise ConfigurationError(f"{message}; strict=True refuses that") from None
        if rank == 0:
            logger.warning(message)
        return None
