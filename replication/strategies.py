"""Replication strategies: pure functions from a topology to where each shard's replicas live.

A strategy returns a :class:`Placement`: for every owner rank, the ranks that keep a replica of its
shard. Strategies are registered by name (:func:`make_strategy`); an unknown name raises and lists
the registered ones.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import TopologyError, UnknownStrategyError
from .topology import Topology


@dataclass(frozen=True)
class Placement:
    """``holders[owner]``: ranks (never the owner) keeping a replica of ``owner``'s shard."""

    holders: tuple[tuple[int, ...], ...]

    def kept_by(self, rank: int) -> list[int]:
        """Owners whose shard ``rank`` is meant to keep a replica of."""
        return [owner for owner, hs in enumerate(self.holders) if rank in hs]


class ReplicationStrategy(ABC):
    """Decides where replicas live. Implementations are pure and deterministic: every rank
    computes the same placement from the same topology."""

    name: ClassVar[str]

    @abstractmethod
    def place(self, topology: Topology) -> Placement:
        """Replica holders per owner; raises TopologyError when the topology does not fit."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    def describe(self) -> dict[str, Any]:
        return {}


_REGISTRY: dict[str, Callable[..., ReplicationStrategy]] = {}


def register_strategy(cls: type[ReplicationStrategy]) -> type[ReplicationStrategy]:
    """Class decorator: make ``cls`` constructible by ``make_strategy(cls.name, ...)``."""
    _REGISTRY[cls.name] = cls
    return cls


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_strategy(name: str, **kwargs: Any) -> ReplicationStrategy:
    """The registered strategy ``name`` built with ``kwargs``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownStrategyError(
            f"replication strategy: expected one of {strategy_names()}, got {name!r}") from None
    return factory(**kwargs)


def _positive_int(name: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise TopologyError(f"{name}: expected an int >= 1, got {value!r}")
    return value


@register_strategy
class NoReplication(ReplicationStrategy):
    """No replicas: the same as ``repl_strategy=None``."""

    name = "none"

    def place(self, topology: Topology) -> Placement:
        return Placement(tuple(() for _ in range(topology.world_size)))


def strategy_setting(strategy: ReplicationStrategy | None) -> list[Any] | None:
    """``strategy`` as JSON, equal for strategies of one kind and parameters (None and
    :class:`NoReplication` both None): what every rank of a job must be given. Parameters
    that are not plain JSON (a custom strategy's set, function or inf: their text differs
    between processes, or JSON has none) are left out; the others are compared."""
    if strategy is None or type(strategy) is NoReplication:
        return None
    kind = type(strategy)
    try:
        described = dict(strategy.describe())
    except Exception:  # a custom describe() may hold anything, or fail
        described = {}
    params = {}
    for key, value in described.items():
        try:
            params[str(key)] = json.loads(json.dumps(value, sort_keys=True, allow_nan=False))
        except Exception:
            continue  # left out: compared by the others, and the kind
    return [f"{kind.__module__}.{kind.__qualname__}", params]


@register_strategy
class CliqueReplicationStrategy(ReplicationStrategy):
    """NVIDIA's clique grouping: ranks m, m+J, m+2J, ... taken F at a time form a group, and every
    member keeps a replica of every other member's shard. With J = ranks per node and
    torchrun's layout, the F members of a group sit on F different nodes."""

    name = "clique"

    def __init__(self, replication_jump: int = 1, replication_factor: int = 2) -> None:
        self.replication_jump = _positive_int("replication_jump", replication_jump)
        self.replication_factor = _positive_int("replication_factor", replication_factor)

    @classmethod
    def from_replication_params(cls, replication_jump: int = 1,
                                replication_factor: int = 2) -> CliqueReplicationStrategy:
        """The constructor under the name NVIDIA's strategy (and Megatron-LM) call it by."""
        return cls(replication_jump, replication_factor)

    def describe(self) -> dict[str, Any]:
        return {"replication_jump": self.replication_jump,
                "replication_factor": self.replication_factor}

    def groups(self, world_size: int) -> list[tuple[int, ...]]:
        jump, factor = self.replication_jump, self.replication_factor
        block = jump * factor
        if world_size % block:
            raise TopologyError(
                f"clique replication: world size must be divisible by replication_jump * "
                f"replication_factor = {jump} * {factor} = {block}, got world size {world_size}")
        return [tuple(start + m + k * jump for k in range(factor))
                for start in range(0, world_size, block) for m in range(jump)]

    def place(self, topology: Topology) -> Placement:
        holders: list[tuple[int, ...]] = [()] * topology.world_size
        for group in self.groups(topology.world_size):
            for rank in group:
                holders[rank] = tuple(g for g in group if g != rank)
        return Placement(tuple(holders))


@register_strategy
class LazyCliqueReplicationStrategy(CliqueReplicationStrategy):
    """The clique grouping, formed on first use and then reused for every save of the job."""

    name = "lazy_clique"

    def __init__(self, replication_jump: int = 1, replication_factor: int = 2) -> None:
        super().__init__(replication_jump, replication_factor)
        self._cache: dict[Topology, Placement] = {}

    def place(self, topology: Topology) -> Placement:
        if topology not in self._cache:
            self._cache[topology] = super().place(topology)
        return self._cache[topology]


@register_strategy
class NodeSpreadReplicationStrategy(ReplicationStrategy):
    """Each shard's F-1 replicas go to F-1 *other* nodes, for any node count >= F.

    The k-th replica of the j-th rank of node i goes to node i + 1 + (j*(F-1) + k) mod (N-1),
    so one node's replicas are spread over all other nodes, and within a node replicas are dealt
    to its ranks in turn. With equal nodes every node keeps the same number of shards (to within
    one); unequal nodes stay close.
    """

    name = "node_spread"

    def __init__(self, replication_factor: int = 2) -> None:
        self.replication_factor = _positive_int("replication_factor", replication_factor)

    def describe(self) -> dict[str, Any]:
        return {"replication_factor": self.replication_factor}

    def place(self, topology: Topology) -> Placement:
        copies = self.replication_factor - 1
        n = topology.num_nodes
        if copies and n < self.replication_factor:
            raise TopologyError(
                f"node_spread replication: replication_factor {self.replication_factor} needs at "
                f"least {self.replication_factor} nodes, got {n}")
        dealt = [0] * n
        holders: list[tuple[int, ...]] = []
        for rank in range(topology.world_size):
            node = topology.node_of[rank]
            local = topology.nodes[node].index(rank)
            chosen = []
            for k in range(copies):
                target = (node + 1 + (local * copies + k) % (n - 1)) % n
                members = topology.nodes[target]
                chosen.append(members[dealt[target] % len(members)])
                dealt[target] += 1
            holders.append(tuple(chosen))
        return Placement(tuple(holders))
