"""The record of the rollbacks a root finished (storage/rollback_fence.py), single process:
what a node records of the rollbacks other roots finished, and the record's bound. Three node
roots are three ShardStores; the job's listing is built as find_latest builds it."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from localckpt.control.context import Context
from localckpt.control.coverage import (
    Inventory,
    complete_iterations,
    decode_inventories,
    job_fence,
)
from localckpt.storage import rollback_fence
from localckpt.storage.manifest import ShardManifest
from localckpt.storage.space import chunking
from localckpt.storage.store import ShardStore

WORLD = 3


def _write(store: ShardStore, iteration: int, owner: int) -> None:
    chunk_nbytes, count = chunking(1000, store.chunk_nbytes)
    store.write(ShardManifest(store.session_id, iteration, owner, WORLD, (), {"dict": []},
                              "plain", 1000, chunk_nbytes, count, ()),
                torch.zeros(chunk_nbytes * count, dtype=torch.uint8))


def _listing(stores: list[ShardStore]) -> list[Inventory]:
    return decode_inventories([Inventory(
        r, "job", frozenset((x.iteration, x.owner_rank, x.world_size) for x in s.committed()),
        s.fence(), s.rollbacks_done()).to_json() for r, s in enumerate(stores)])


def _note(stores: list[ShardStore], inventories: list[Inventory]) -> None:
    for rank, store in enumerate(stores):  # what find_latest and a save do on each rank
        Context.note_rollbacks_done(types.SimpleNamespace(  # type: ignore[arg-type]
            rank=rank, store=store, session_id="job"), inventories)


def test_a_node_away_during_a_rollback_is_not_recorded_as_having_finished_it(
        tmp_path: Path) -> None:
    """Node X was away during rollback R to 20 (no fence; it still holds the discarded 30);
    node A died in R after its fence was written; node B finished R and saved 25. Back
    together, the job recorded R on X (X held no fence of R): X's 30 was shown again, listed
    as the newest, and the next save kept it. A root holding a shard R would hide is not
    recorded: R is finished there by deleting it (attacker review)."""
    a, b, x = (ShardStore(tmp_path / n, "job", writer_rank=0, chunk_nbytes=4096)
               for n in "abx")
    stores = [a, b, x]
    try:
        for store in stores:  # every node holds every shard
            for it in (10, 20, 30):
                for owner in range(WORLD):
                    _write(store, it, owner)
        rid = rollback_fence.new_rollback_id()
        a.fence_rollback(20, WORLD, a.fence(), rid)
        b.fence_rollback(20, WORLD, b.fence(), rid)
        assert b.finish_rollback() == []
        b.wait_for_deletions()
        for owner in range(WORLD):
            _write(b, 25, owner)
        listing = _listing(stores)
        assert complete_iterations(listing, WORLD)[0] == 25
        _note(stores, listing)
        assert x.rollbacks_done() == frozenset()
        listing = _listing(stores)
        assert complete_iterations(listing, WORLD)[0] == 25
        fence = job_fence(listing)  # the next save finishes the rollback
        for store in stores:
            assert store.discard_fenced(fence) == []
            store.lift_fence()
            store.wait_for_deletions()
        assert sorted(complete_iterations(_listing(stores), WORLD)) == [10, 20, 25]
        assert x.rollbacks_done() == {(rid, 20, WORLD)}
        # a node that joins later, empty, is recorded (what it is given comes after R)
        fresh = ShardStore(tmp_path / "fresh", "job", writer_rank=0, chunk_nbytes=4096)
        try:
            _note([a, fresh], _listing([a, fresh]))
            assert fresh.rollbacks_done() == {(rid, 20, WORLD)}
        finally:
            fresh.close()
    finally:
        for store in stores:
            store.close()


def test_the_record_keeps_the_newest_rollbacks_and_settles(tmp_path: Path) -> None:
    """Root A finished rollbacks 1-9 (it keeps 2-9), root C 1-8. Each listing added to each
    root the id the other had and dropped its own oldest: both records were rewritten at
    every find_latest, and after a few A lacked rollback 9, its newest, so a node back with
    rollback 9's fence would have hidden (and the next save deleted) what A saved after it.
    The newest are kept by age, and a listing that changes nothing writes nothing."""
    a, c = (ShardStore(tmp_path / n, "job", writer_rank=0) for n in "ac")
    try:
        ids = [f"{i:012x}{'0' * 8}" for i in range(1, 10)]  # as new_rollback_id: by age
        for rid in ids:
            a.record_rollbacks_done([(rid, 5, None)])
        for rid in ids[:8]:
            c.record_rollbacks_done([(rid, 5, None)])
        done = a.session_path / rollback_fence.DONE_NAME
        assert {d[0] for d in a.rollbacks_done()} == set(ids[1:])
        written = done.stat().st_ino
        for _ in range(rollback_fence.DONE_KEPT + 2):
            _note([a, c], _listing([a, c]))
            assert ids[-1] in {d[0] for d in a.rollbacks_done()}
        assert {d[0] for d in c.rollbacks_done()} == set(ids[1:])
        assert done.stat().st_ino == written  # not rewritten
    finally:
        a.close()
        c.close()
