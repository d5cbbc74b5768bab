"""Which node each rank lives on.

Nodes are numbered by their lowest rank, not by name, so a node replaced by a new machine with the
same ranks (as torchrun assigns them) keeps its index and every placement stays the same.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

NODE_ID_ENV = "LOCALCKPT_NODE_ID"


def local_node_name(override: str | None = None) -> str:
    """This process's node: ``override``, else $LOCALCKPT_NODE_ID (tests and several simulated
    nodes on one machine set it), else the hostname."""
    return override or os.environ.get(NODE_ID_ENV) or socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """Node names per rank, and the derived node index per rank and ranks per node."""

    node_names: tuple[str, ...]
    node_of: tuple[int, ...] = field(init=False)
    nodes: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        members: list[list[int]] = []
        node_of = []
        for rank, name in enumerate(self.node_names):
            if name not in index:
                index[name] = len(members)
                members.append([])
            members[index[name]].append(rank)
            node_of.append(index[name])
        object.__setattr__(self, "node_of", tuple(node_of))
        object.__setattr__(self, "nodes", tuple(tuple(m) for m in members))

    @classmethod
    def uniform(cls, num_nodes: int, ranks_per_node: int) -> Topology:
        """``num_nodes`` nodes of ``ranks_per_node`` consecutive ranks (torchrun's layout)."""
        return cls(tuple(f"node{r // ranks_per_node}"
                         for r in range(num_nodes * ranks_per_node)))

    @property
    def world_size(self) -> int:
        return len(self.node_names)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def leader(self, rank: int) -> int:
        """The lowest rank on ``rank``'s node: the one that prunes the node's shared root."""
        return self.nodes[self.node_of[rank]][0]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]
