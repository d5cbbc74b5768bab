"""The Megatron-LM drop-in (issue 20, item 1): Megatron's MCoreTensorAwareStateDict saved and
loaded without pickle, async saves scheduled and finalized by Megatron's own AsyncCallsQueue,
and a restore after a node was wiped. Skipped where megatron-core does not import."""

from __future__ import annotations

import multiprocessing
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core.dist_checkpointing", reason="needs megatron-core")

import megatron_scenarios as sc
from dist_harness import run_ranks


def test_megatrons_queue_finalizes_our_saves_and_a_wiped_node_restores(tmp_path: Path) -> None:
    """Megatron's AsyncCallsQueue (persistent=False, its default: a process forked per save
    runs the request's async_fn) schedules and finalizes three async saves; node 1 is then
    wiped, and the job's next start loads the newest iteration for Megatron's to_state_dict."""
    base = str(tmp_path / "roots")
    saved = run_ranks(sc.save_through_megatrons_queue, 2, tmp_path, base, False, deadline=120)
    assert [r.value for r in saved] == [30, 30], [r.message for r in saved]
    shutil.rmtree(tmp_path / "roots" / "node1")  # node 1 lost; its replacement is empty
    loaded = run_ranks(sc.load_for_megatron, 2, tmp_path, base, deadline=120)
    assert all(r.ok for r in loaded), [r.message for r in loaded]
    for r in loaded:
        assert r.value == {"latest": 30, "ckpt_id": [30, r.rank, "mcore"], "kind": True,
                           "weights": True, "rng": True, "args": True}
    assert (tmp_path / "roots" / "node1" / "mcore" / "iter_0000000030").is_dir()


def _wait_pickled(payload: bytes, out: Any) -> None:
    from localckpt.save.job import wait_for_save

    signal = pickle.loads(payload)
    out.put("waiting")
    wait_for_save(signal)
    out.put(time.time())


def test_a_request_waits_in_a_process_it_was_sent_to() -> None:
    """Megatron's persistent worker (spawned before the save, CUDA-only itself) gets each
    request pickled: its async_fn must wait there for the save's work, then return."""
    from localckpt.save.job import DoneSignal

    done = DoneSignal()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    worker = ctx.Process(target=_wait_pickled, args=(pickle.dumps(done), out))
    worker.start()
    try:
        assert out.get(timeout=60) == "waiting"
        time.sleep(0.3)
        assert out.empty()  # still waiting
        set_at = time.time()
        done.set()
        assert out.get(timeout=30) >= set_at
    finally:
        worker.join(30)
    assert worker.exitcode == 0 and done.wait(0)


def test_distributed_optimizer_and_rerun_state_round_trip(tmp_path: Path) -> None:
    """Megatron's distributed optimizer keys its bucket state by dtype tuples (refused at save
    before), ShardedTensor.narrow leaves a torch.Size as local_shape (refused), and the rerun
    state machine's failed call is a named tuple of megatron.core (saved, then refused by every
    load). A type no load may build is now refused by the save, on every rank."""
    base = str(tmp_path / "roots")
    results = run_ranks(sc.save_and_load_optimizer_shapes, 2, tmp_path, base, deadline=120)
    assert all(r.ok for r in results), [r.message for r in results]
    for r in results:
        refused = r.value.pop("refused")
        assert r.value == {"keys": True, "exp_avg": True, "numel": True, "call": True,
                           "latest": 5}, r.value
        assert refused.startswith("UnsafeTypeError") and "NotAllowed" in refused \
            and "allow(" in refused, refused
