"""The rollback fence operations of a :class:`~localckpt.storage.store.ShardStore` (a mixin).

A rollback hides a root's shards newer than an iteration behind a fence file, deletes them, then
records the rollback as finished and lifts the fence (see :mod:`.rollback_fence` for the files
and why a finished rollback must be remembered).
"""

from __future__ import annotations

from pathlib import Path

from .layout import ShardRef, list_shards
from .rollback_fence import (
    FENCE_NAME,
    Done,
    Fence,
    finished_by,
    hidden,
    merged,
    read_done,
    read_fence,
    record_done,
    remove_fence,
    unfinished,
    write_fence,
)


class RollbackOps:
    """Rollback fence methods of a store; the store provides the attributes below."""

    root: Path
    session_id: str
    session_path: Path
    _tag: str

    def delete(self, ref: ShardRef, background: bool = False) -> None:
        raise NotImplementedError

    def fence(self) -> Fence | None:
        """This root's rollback fence (see :mod:`.rollback_fence`), or None."""
        return read_fence(self.session_path)

    def rollbacks_done(self) -> frozenset[Done]:
        """The rollbacks finished on this root: a fence of one of them hides none of its
        shards (see :mod:`.rollback_fence`)."""
        return read_done(self.session_path)

    def record_rollbacks_done(self, done: list[Done]) -> None:
        """Record ``done`` as finished on this root (OSError when that fails)."""
        record_done(self.session_path, done, self._tag)

    def fence_rollback(self, iteration: int, world_size: int | None,
                       before: Fence | None, rollback_id: str) -> None:
        """Hide this root's shards newer than ``iteration`` (of ``world_size``; None: of
        every world size) from every listing, durably, until :meth:`finish_rollback` deleted
        them. ``before``: the fence already there (:meth:`fence`), read by every rank sharing
        this root before any of them wrote (what :meth:`cancel_rollback` puts back);
        ``rollback_id``: the same on every rank."""
        write_fence(self.session_path,
                    merged(before, ((iteration, world_size, rollback_id),)), self._tag,
                    merge=False)

    def cancel_rollback(self, before: Fence | None = None) -> None:
        """Put back this root's fence as it was ``before`` a rollback that deleted nothing
        (None: remove it)."""
        if before is None:
            remove_fence(self.session_path)
        else:
            write_fence(self.session_path, before, self._tag, merge=False)

    def discard_fenced(self, fence: Fence | None = None) -> list[str]:
        """Delete the shards this root's fence hides (and those ``fence`` hides, the job's:
        adopted as this root's first), but for rollbacks this root finished (what it holds
        above their iteration was saved after them); what failed, as text. Never raises
        (ranks must not part here). The space is freed in the background."""
        try:
            if fence is not None:
                write_fence(self.session_path, fence, self._tag)
            mine = unfinished(read_fence(self.session_path), self.rollbacks_done())
        except OSError as exc:
            return [str(exc)]
        failed = []
        for ref in list_shards(self.root, self.session_id, fenced=False):
            if hidden(mine, ref.iteration, ref.world_size):
                try:
                    self.delete(ref, background=True)
                except OSError as exc:
                    failed.append(f"{ref.path}: {exc}")
        return failed

    def lift_fence(self) -> None:
        """Once the rollbacks of this root's fence are finished on every root: record them as
        finished here, then remove the fence (OSError when either fails)."""
        done = finished_by(read_fence(self.session_path))
        if done:
            record_done(self.session_path, done, self._tag)
        remove_fence(self.session_path)

    def finish_rollback(self) -> list[str]:
        """:meth:`discard_fenced`, then :meth:`lift_fence` (the rollbacks recorded as
        finished here, then the fence goes; kept if a deletion failed: those shards stay
        hidden). What failed, as text; never raises."""
        failed = self.discard_fenced()
        if not failed:
            try:
                self.lift_fence()
            except OSError as exc:
                failed.append(f"{self.session_path / FENCE_NAME}: {exc}")
        return failed
