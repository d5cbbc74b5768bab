"""Rank functions for the background write-back of a restore (run by tests/test_write_back.py on
real gloo ranks; one rank per simulated node)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
from scenarios import digest, make_state

from localckpt import LocalCheckpointManager
from localckpt.storage.layout import find_leftovers, list_shards, session_dir
from replication import make_strategy


def big_state(rank: int, iteration: int) -> dict[str, Any]:
    """make_state plus tensors large enough to arrive in place (shard_stream.DIRECT_MIN_NBYTES)
    beside small ones in one piece."""
    g = torch.Generator().manual_seed(rank * 7 + iteration)
    return make_state(rank, iteration) | {
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB
        "big_bf16": torch.randn(1 << 20, generator=g).to(torch.bfloat16),  # 2 MiB
    }


def manager(rank: int, base: str, factor: int = 2, timeout: float = 30, keep_last: int = 1
            ) -> LocalCheckpointManager:
    return LocalCheckpointManager(Path(base) / f"node{rank}", "job",
                                  make_strategy("node_spread", replication_factor=factor),
                                  timeout=timeout, chunk_nbytes=1 << 20, node_id=f"node{rank}",
                                  keep_last=keep_last)


def save(rank: int, world: int, base: str, iterations: list[int], factor: int = 2,
         keep_last: int = 1) -> None:
    with manager(rank, base, factor, keep_last=keep_last) as mgr:
        for it in iterations:
            mgr.save(big_state(rank, it), it)


def held(base: str, node: int) -> list[list[int]]:
    return sorted([s.iteration, s.owner_rank] for s in list_shards(Path(base) / f"node{node}",
                                                                    "job"))


def _wait_for(path: Path, seconds: float = 60) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def load_with_write_back_held(rank: int, world: int, base: str, gate: str) -> dict[str, Any]:
    """Node 1 was wiped. Rank 1's write-back is held back until every rank's ``load`` returned
    and rank 1 looked at its empty node: no load may wait for the write-back."""
    from localckpt.load import write_back

    real_sink = write_back.WriteBack._sink
    gates = [Path(gate) / f"loaded{r}" for r in range(world)]

    def held_sink(self: Any, *args: Any) -> Any:
        for g in gates:
            _wait_for(g)
        return real_sink(self, *args)

    write_back.WriteBack._sink = held_sink  # type: ignore[method-assign]
    with manager(rank, base) as mgr:
        loaded, ckpt_id = mgr.load()
        on_node_before = held(base, rank)
        gates[rank].touch()
        mgr.wait_for_write_back()
        on_node_after = held(base, rank)
    return {"digest": digest(loaded), "expected": digest(big_state(rank, ckpt_id[0])),
            "iteration": ckpt_id[0], "before": on_node_before, "after": on_node_after}


def load_then_save(rank: int, world: int, base: str, next_iteration: int,
                   failures: int) -> dict[str, Any]:
    """load with rank 1's write-back failing ``failures`` times, then one more save and load."""
    from localckpt.ops import faults

    fault = faults.Fault("load_write_back", "raise", rank=1, times=failures)
    faults.arm(fault)
    with manager(rank, base) as mgr:
        loaded, ckpt_id = mgr.load()
        first = digest(loaded) == digest(big_state(rank, ckpt_id[0]))
        mgr.wait_for_write_back()
        fired = failures - fault.times
        after_load = held(base, rank)
        leftovers = find_leftovers(session_dir(Path(base) / f"node{rank}", "job"))
        mgr.save(big_state(rank, next_iteration), next_iteration)
        reloaded, again = mgr.load()
    return {"first_ok": first, "iteration": ckpt_id[0], "after_load": after_load,
            "leftovers": [str(p) for p in leftovers], "fired": fired,
            "after_save": held(base, rank), "second": again[0],
            "second_ok": digest(reloaded) == digest(big_state(rank, again[0]))}


def load_and_wait(rank: int, world: int, base: str, factor: int) -> dict[str, Any]:
    with manager(rank, base, factor) as mgr:
        loaded, ckpt_id = mgr.load()
        mgr.wait_for_write_back()
    return {"ok": digest(loaded) == digest(big_state(rank, ckpt_id[0])), "iteration": ckpt_id[0],
            "held": held(base, rank)}


def write_back_group_lost(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 1's write-back stalls past the timeout (the data group fails under it): the load
    went well, and the next call on every rank raises at once, naming the write-back."""
    from localckpt.ops import faults

    faults.arm(faults.Fault("load_write_back", "sleep", rank=1, seconds=5))
    with manager(rank, base, timeout=2) as mgr:
        loaded, ckpt_id = mgr.load()
        ok = digest(loaded) == digest(big_state(rank, ckpt_id[0]))
        try:
            mgr.save(big_state(rank, 4), 4)
            error = None
        except Exception as exc:
            error = [type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc)]
    return {"ok": ok, "error": error}


def rollback_with_a_write_back_failed_on_rank_1(rank: int, world: int,
                                                base: str) -> dict[str, Any]:
    """load(iteration=3, discard_newer=True) while rank 1's write-back failed on rank 1 alone
    (a local failure after its last transfer): no rank may discard iteration 5."""
    from localckpt.errors import CollectiveError
    from localckpt.load.loader import LoadPath

    if rank == 1:
        real, calls = LoadPath.wait_for_write_back, []

        def failed(self: LoadPath) -> None:  # the wait after the load itself: failed here
            calls.append(1)
            if len(calls) == 2:
                raise CollectiveError("the write-back of iteration 3 after the last load failed")
            real(self)
        LoadPath.wait_for_write_back = failed  # type: ignore[method-assign]
    mgr = manager(rank, base, timeout=5, keep_last=2)
    try:
        mgr.load(iteration=3, discard_newer=True)
        error = None
    except Exception as exc:
        error = type(exc).__name__
    finally:
        with contextlib.suppress(Exception):
            mgr.close()
    time.sleep(1)  # a background deletion would be done by now
    return {"error": error, "held": held(base, rank)}


def counted_write_back(rank: int, world: int, base: str, phase: str) -> dict[str, Any]:
    """Save 40 MiB shards (several pieces on the wire each); after node 1 was wiped, start the
    write-back a resharding load starts (write_back_after: no load step counted the pieces)
    and report how long one attempt may take. ``phase`` "busy": the sender's first manifest
    read fails for want of file descriptors (EMFILE: the process's trouble, not the copy's)."""
    import errno

    from localckpt.load.restore import write_back_after

    with manager(rank, base, timeout=2) as mgr:
        if phase == "save":
            mgr.save({"w": torch.full((10 << 20,), float(rank))}, 1)
            return {}
        ctx = mgr._ctx
        if phase == "busy":
            real, failed = ctx.store.read_manifest, []

            def busy(ref: Any) -> Any:
                if not failed:
                    failed.append(ref)
                    raise OSError(errno.EMFILE, "Too many open files")
                return real(ref)

            ctx.store.read_manifest = busy  # type: ignore[method-assign]
        write_back = write_back_after(ctx, 1, ctx.gather_inventories("listing"), None)
        assert write_back is not None
        write_back.wait()
        return {"seconds": write_back.seconds, "written": write_back.written}
