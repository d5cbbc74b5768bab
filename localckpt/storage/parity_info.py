"""What a parity block's manifest says it is (format version 5): which block of which stripe of
a k + m code, over which members' shards, and those shards' sizes and manifests. A lost
member's shard is rebuilt from any k blocks of its stripe and gets its manifest back from any
parity block: a node replaced by an empty one has neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CorruptShardError

PARITY_FORMAT_VERSION = 5


@dataclass(frozen=True)
class ParityInfo:
    """Parity block ``block`` (0 <= block < m) of stripe ``stripe`` of a ``k`` + ``m`` code over
    the shards of ``members`` (ranks, in stripe order): ``sizes[i]`` is member i's packed data
    (its chunks, padding included: what was encoded), ``manifests[i]`` its manifest as JSON
    (with its own checksum). The block is ``max(sizes)`` long."""

    k: int
    m: int
    stripe: int
    block: int
    members: tuple[int, ...]
    sizes: tuple[int, ...]
    manifests: tuple[dict[str, Any], ...]

    def to_json(self) -> dict[str, Any]:
        return {"k": self.k, "m": self.m, "stripe": self.stripe, "block": self.block,
                "members": list(self.members), "sizes": list(self.sizes),
                "manifests": list(self.manifests)}

    @classmethod
    def from_json(cls, doc: Any, world_size: int, where: str) -> ParityInfo:
        """Parse and check ``doc`` (the manifest's ``"parity"``); CorruptShardError naming
        ``where`` when it is malformed or inconsistent."""
        def bad(what: str) -> CorruptShardError:
            return CorruptShardError(f"{where}: inconsistent parity block: {what}")

        if type(doc) is not dict:
            raise bad(f"expected an object, got {type(doc).__name__}")
        try:
            k, m, stripe, block = (doc[key] for key in ("k", "m", "stripe", "block"))
            members, sizes, manifests = doc["members"], doc["sizes"], doc["manifests"]
        except KeyError as exc:
            raise bad(f"no {exc}") from None
        if not all(type(x) is int for x in (k, m, stripe, block)) or not (
                k >= 1 and 1 <= m < 100 and 0 <= block < m and 0 <= stripe < world_size):
            raise bad(f"block {block!r} of stripe {stripe!r} of a {k!r}+{m!r} code")
        if type(members) is not list or not 1 <= len(members) <= k or not all(
                type(r) is int and 0 <= r < world_size for r in members) or \
                len(set(members)) != len(members):
            raise bad(f"members {str(members)[:100]} (expected 1 to {k} distinct ranks)")
        if type(sizes) is not list or len(sizes) != len(members) or not all(
                type(n) is int and n >= 0 for n in sizes):
            raise bad(f"sizes {str(sizes)[:100]} for {len(members)} members")
        if type(manifests) is not list or len(manifests) != len(members) or not all(
                type(d) is dict for d in manifests):
            raise bad(f"expected a manifest per member, got {str(manifests)[:60]}")
        return cls(k, m, stripe, block, tuple(members), tuple(sizes), tuple(manifests))
