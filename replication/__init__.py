"""replication: where checkpoint shards are replicated across nodes, and the moving of their bytes.

Works on opaque shard payloads (bytes + ids) and never imports localckpt; localckpt imports it.
Strategies and plans are pure; :mod:`replication.executor` moves bytes over a process group.
"""

from .erasure import ErasureCodingStrategy, StripeLayout, parity_of_slot, parity_slot
from .errors import ReplicationError, StaleTransferError, TopologyError, UnknownStrategyError
from .plans import (
    ExchangePlan,
    RetrievalPlan,
    Transfer,
    owners_without_remote_copy,
    retrieval_plan,
    save_plan,
    schedule,
    wanted_shards,
)
from .strategies import (
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
    NodeSpreadReplicationStrategy,
    NoReplication,
    Placement,
    ReplicationStrategy,
    make_strategy,
    register_strategy,
    strategy_names,
)
from .topology import Topology, local_node_name

__all__ = [
    "CliqueReplicationStrategy",
    "ErasureCodingStrategy",
    "ExchangePlan",
    "LazyCliqueReplicationStrategy",
    "NoReplication",
    "NodeSpreadReplicationStrategy",
    "Placement",
    "ReplicationError",
    "ReplicationStrategy",
    "StripeLayout",
    "RetrievalPlan",
    "StaleTransferError",
    "Topology",
    "TopologyError",
    "Transfer",
    "UnknownStrategyError",
    "local_node_name",
    "make_strategy",
    "owners_without_remote_copy",
    "parity_of_slot",
    "parity_slot",
    "register_strategy",
    "retrieval_plan",
    "save_plan",
    "schedule",
    "strategy_names",
    "wanted_shards",
]
