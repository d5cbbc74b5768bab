"""Errors of the replication package (it does not import localckpt; localckpt re-exports these)."""

from __future__ import annotations


class ReplicationError(RuntimeError):
    """Base class of replication errors."""


class UnknownStrategyError(ReplicationError, ValueError):
    """A strategy name that is not registered; the message lists the registered ones."""


class TopologyError(ReplicationError, ValueError):
    """A strategy cannot place replicas on this topology (world size, node count)."""


class StaleTransferError(ReplicationError):
    """A peer sent a shard other than the one the plan expects (iteration or owner differ)."""
