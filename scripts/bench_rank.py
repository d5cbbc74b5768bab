"""One benchmark configuration on one rank: raw limits, localckpt's phases, and the baselines.

Every rank of a spawned world runs :func:`measure`. Each figure is the wall time of one
operation done by all ranks at once (barrier before, max over ranks after), so raw limits and
phases see the same contention on the same cores; rank 0 writes every figure's samples to JSON.

Ranks ``0 .. W/2-1`` form node 0, the rest node 1 (gloo on loopback, one root per node).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import bench_cases
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from localckpt import AsyncCallsQueue, LocalCheckpointManager, PhaseMetric
from localckpt.storage.checksum import crc32c
from localckpt.storage.host_memory import advise_huge_pages, empty_host
from replication import (
    Topology,
    make_strategy,
    retrieval_plan,
    save_plan,
    schedule,
    wanted_shards,
)
from replication.plans import ExchangePlan


def raw_write(path: Path, buf: memoryview) -> None:
    """One thread writes ``buf`` to ``path`` and fsyncs it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = buf
        while view:
            view = view[os.write(fd, view[: 1 << 30]):]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, out: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < len(out):
            got += f.readinto(out[got:])


class Timer:
    """Collective wall-time samples: ``t.run(name, fn)`` on every rank, same order."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    def run(self, name: str, fn: Callable[[], Any], before: Callable[[], Any] | None = None
            ) -> None:
        if before is not None:
            before()
        dist.barrier()
        t = time.perf_counter()
        fn()
        self.add({name: time.perf_counter() - t})

    def add(self, local: dict[str, float]) -> None:
        """Record the max over ranks of each of this rank's values (collective)."""
        values = torch.tensor(list(local.values()), dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        for name, v in zip(local, values.tolist(), strict=True):
            self.samples[name].append(v)


def _transfers(plan: ExchangePlan, rank: int, send: torch.Tensor, sink: torch.Tensor,
               write_to: Path | None = None) -> None:
    """The plan's transfers for this rank, done with bare send/recv of ``send``'s bytes; with
    ``write_to``, each received buffer is then written to a fresh file there."""
    for k, t in enumerate(plan.involving(rank)):
        if t.src == rank:
            dist.send(send, t.dst)
        else:
            dist.recv(sink, t.src)
            if write_to is not None:
                raw_write(write_to.with_suffix(f".{k}"), memoryview(sink.numpy()))


def measure_raw(timer: Timer, case: bench_cases.Case, rank: int, world: int, base: Path,
                placement: Any, topology: Topology, repeats: int) -> None:
    """memcpy, crc32c, tmpfs write (fresh, in place) and read (warm, fresh), gloo one direction
    (node 0 -> node 1, every pair at once) and the replication schedule with bare send/recv."""
    src = case.payload
    dst = advise_huge_pages(torch.empty_like(src))  # as localckpt's staging arena is
    dst.fill_(0)
    src_mv, dst_mv = memoryview(src.numpy()), memoryview(dst.numpy())
    path, copy = base / f"raw{rank}.bin", base / f"raw-received{rank}.bin"
    per_node = world // 2
    partner, sender = (rank + per_node) % world, rank < per_node
    plan = save_plan(placement, topology, 0) if placement is not None else None
    for _ in range(repeats):
        timer.run("memcpy", lambda: dst.copy_(src))
        timer.run("crc32c", lambda: crc32c(src_mv))
        timer.run("tmpfs_write_fresh", lambda: raw_write(path, src_mv),
                  lambda: path.unlink(missing_ok=True))
        fd = os.open(path, os.O_WRONLY)
        timer.run("tmpfs_write_in_place", lambda fd=fd: os.pwrite(fd, src_mv, 0))
        os.close(fd)
        timer.run("tmpfs_read", lambda: raw_read(path, dst_mv))
        timer.run("tmpfs_read_fresh", lambda: raw_read(
            path, memoryview(empty_host(case.nbytes).numpy())))
        timer.run("gloo_one_direction",
                  lambda: dist.send(src, partner) if sender else dist.recv(dst, partner))
        if plan is not None:
            timer.run("gloo_save_schedule", lambda: _transfers(plan, rank, src, dst))
            # the least a replica costs: received, then written to a fresh tmpfs file
            timer.run("gloo_save_schedule_and_write",
                      lambda: _transfers(plan, rank, src, dst, write_to=copy),
                      lambda: [p.unlink() for p in base.glob(f"{copy.stem}.*")])
    path.unlink(missing_ok=True)
    for p in base.glob(f"{copy.stem}.*"):
        p.unlink()


def measure_localckpt(timer: Timer, case: bench_cases.Case, rank: int, world: int, base: Path,
                      factor: int, repeats: int, io_threads: int | None,
                      recycle_files: bool = False) -> None:
    """Async save (stall, write, replicate, finalize, call-to-finalized), find_latest and load
    from local disk by a new manager (a restart); with replicas, load after node 1 was wiped
    against raw read + transfer."""
    per_node = world // 2
    node = rank // per_node
    root = base / f"node{node}"
    strategy = make_strategy("node_spread", replication_factor=factor) if factor > 1 else None
    records: list[PhaseMetric] = []
    mgr = LocalCheckpointManager(root, "bench", strategy, timeout=900, node_id=f"node{node}",
                                 metrics=records.append, io_threads=io_threads,
                                 recycle_files=recycle_files)
    queue = AsyncCallsQueue(timeout=900)
    # A fresh job: memory reserved (the arena and receive buffers touched), then its first save
    timer.run("reserve", lambda: mgr.reserve(case.state))
    timer.run("first_save", lambda: mgr.save(case.state, 0))
    template = bench_cases.zeros_like(case.state)
    for it in range(1, repeats + 1):
        records.clear()
        dist.barrier()
        t = time.perf_counter()
        req = mgr.save(case.state, it, is_async=True)
        stall = time.perf_counter() - t
        queue.schedule_async_request(req)  # type: ignore[arg-type]
        queue.maybe_finalize_async_calls(blocking=True)
        total = time.perf_counter() - t
        phase = {r.phase: r.seconds for r in records if r.iteration == it}
        figures = {"stall": stall, "write": phase["write"], "finalize": phase["finalize"],
                   "async_save_to_finalized": total}
        if strategy is not None:
            figures["replicate"] = phase["replicate"]
        timer.add(figures)
        # As after a restart: a new manager, which has parsed no manifest yet.
        fresh = LocalCheckpointManager(root, "bench", strategy, timeout=900,
                                       node_id=f"node{node}", io_threads=io_threads,
                                       recycle_files=recycle_files)
        timer.run("find_latest", fresh.find_latest)
        timer.run("load_local", fresh.load)
        # as a restart that built its model first: into the caller's (warm) tensors
        timer.run("load_local_into", lambda f=fresh: f.load(into=template))
        fresh.close()
    queue.close()
    timer.run("steady_save", lambda: mgr.save(case.state, repeats + 1))  # sync, as the first
    mgr.close()
    if strategy is not None:
        _node_loss(timer, case, rank, world, root, strategy, repeats, io_threads)
    dist.barrier()
    if rank % per_node == 0:
        shutil.rmtree(root, ignore_errors=True)


def _node_loss(timer: Timer, case: bench_cases.Case, rank: int, world: int, root: Path,
               strategy: Any, repeats: int, io_threads: int | None) -> None:
    """Wipe node 1, then find_latest + load on every rank (node 1's ranks receive their shards;
    node 1's copies are written back in the background, timed on their own). Raw limits:
    ``raw_overlapped_restore``, what load must do at least, overlapped: every rank with its shard
    on disk reads it into fresh memory (a thread) while each holder reads the shard of a node-1
    rank into a warm buffer and sends it, received into fresh memory (the issue's max(own read,
    replica read + transfer)); ``raw_read_and_transfer``: every source reads all it serves, then
    every transfer of the whole plan, one after the other; plus the write of what is received."""
    per_node = world // 2
    topology = Topology(tuple(f"node{r // per_node}" for r in range(world)))
    lost = set(range(per_node, world))
    present = [frozenset() if r in lost else frozenset((0, o) for o in range(world))
               for r in range(world)]
    plan = retrieval_plan(wanted_shards(strategy.place(topology), topology, 0, present),
                          {(0, o): [r for r in range(world) if r not in lost]
                           for o in range(world)})
    fetches = schedule(t for t in plan.exchange.transfers if t.dst == t.owner)
    path = root.parent / f"served{rank}.bin"
    raw_write(path, memoryview(case.payload.numpy()))
    served = len(plan.sources_of(rank))
    warm = torch.empty(case.nbytes, dtype=torch.uint8)
    warm.fill_(0)

    written_back = root.parent / f"written-back{rank}"

    def raw_restore(write_back: bool) -> None:
        for _ in range(served):
            raw_read(path, memoryview(empty_host(case.nbytes).numpy()))
        _transfers(plan.exchange, rank, case.payload,
                   empty_host(case.nbytes),
                   write_to=written_back if write_back else None)

    def raw_overlapped() -> None:
        with ThreadPoolExecutor(1) as own:
            reading = own.submit(raw_read, path, memoryview(
                empty_host(case.nbytes).numpy())) if rank not in lost \
                else None
            for t in fetches.involving(rank):
                if t.src == rank:
                    raw_read(path, memoryview(warm.numpy()))
                    dist.send(warm, t.dst)
                else:
                    dist.recv(empty_host(case.nbytes), t.src)
            if reading is not None:
                reading.result()

    for _ in range(repeats):
        timer.run("raw_overlapped_restore", raw_overlapped)
        timer.run("raw_read_and_transfer", lambda: raw_restore(False))
        # what a restore that brings back redundancy does at least: fetched shards written
        timer.run("raw_read_transfer_and_write_back", lambda: raw_restore(True),
                  lambda: [p.unlink() for p in root.parent.glob(f"{written_back.name}.*")])
        for p in root.parent.glob(f"{written_back.name}.*"):
            p.unlink()
        dist.barrier()
        if rank == per_node:
            shutil.rmtree(root)
        dist.barrier()
        mgr = LocalCheckpointManager(root, "bench", strategy, timeout=900,
                                     node_id=f"node{rank // per_node}", io_threads=io_threads)
        timer.run("load_after_node_loss", lambda m=mgr: (m.find_latest(), m.load()))
        timer.run("write_back_after_load", mgr.wait_for_write_back)
        mgr.close()
    path.unlink()


def measure_baselines(timer: Timer, case: bench_cases.Case, rank: int, world: int, base: Path,
                      factor: int, repeats: int) -> None:
    """torch.save / torch.load of the rank's state to a tmpfs file; with replicas, torch.save plus
    sending the file to the peer on the other node by hand; DCP save / async_save / load of every
    rank's state (distinct keys per rank, so each rank writes its own data)."""
    per_node = world // 2
    partner = (rank + per_node) % world
    path, copy = base / f"torch{rank}.pt", base / f"replica-of-{partner}.pt"
    for _ in range(repeats):
        timer.run("torch_save", lambda: torch.save(case.state, path),
                  lambda: path.unlink(missing_ok=True))
        timer.run("torch_load", lambda: torch.load(path, weights_only=True))
        if factor > 1:
            timer.run("torch_save_and_replicate",
                      lambda: (torch.save(case.state, path),
                               _send_file_to_partner(path, copy, rank, partner, per_node)),
                      lambda: (path.unlink(missing_ok=True), copy.unlink(missing_ok=True)))
    path.unlink(missing_ok=True)
    copy.unlink(missing_ok=True)
    state = {f"rank{rank}": case.state}
    for k in range(repeats):
        directory = base / f"dcp{k}"
        timer.run("dcp_save", lambda d=directory: dcp.save(state, checkpoint_id=d))
        timer.run("dcp_load", lambda d=directory: dcp.load(state, checkpoint_id=d))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)
        dist.barrier()
        t = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=directory)
        stall = time.perf_counter() - t
        future.result()  # type: ignore[union-attr]
        timer.add({"dcp_async_stall": stall, "dcp_async_save": time.perf_counter() - t})
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)


def _send_file_to_partner(path: Path, copy: Path, rank: int, partner: int, per_node: int
                          ) -> None:
    """Node 0's ranks send first, then node 1's (gloo is fastest one direction at a time); the
    receiver maps a new tmpfs file and receives straight into it."""
    size = torch.tensor([path.stat().st_size], dtype=torch.int64)
    other = torch.empty(1, dtype=torch.int64)
    for sending in (rank < per_node, rank >= per_node):
        if sending:
            dist.send(size, partner)
            dist.send(torch.from_file(str(path), shared=True, size=int(size),
                                      dtype=torch.uint8), partner)
        else:
            dist.recv(other, partner)
            with open(copy, "wb") as f:
                f.truncate(int(other))
            dist.recv(torch.from_file(str(copy), shared=True, size=int(other),
                                      dtype=torch.uint8), partner)


def measure(rank: int, store_path: str, base_dir: str, out: str, config: dict[str, Any]) -> None:
    """Entry point of a spawned rank: every figure of ``config`` (see bench.py)."""
    torch.set_num_threads(1)
    world, factor, repeats = config["world"], config["factor"], config["repeats"]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=900))
    base = Path(base_dir)
    base.mkdir(parents=True, exist_ok=True)
    case = bench_cases.build(config["case"], config["nbytes"], seed=rank, **config["case_args"])
    per_node = world // 2
    topology = Topology(tuple(f"node{r // per_node}" for r in range(world)))
    placement = make_strategy("node_spread", replication_factor=factor).place(topology) \
        if factor > 1 else None
    timer = Timer()
    steps = config.get("steps", ("raw", "localckpt", "baselines"))
    if "raw" in steps:
        measure_raw(timer, case, rank, world, base, placement, topology, repeats)
    if "localckpt" in steps:
        measure_localckpt(timer, case, rank, world, base, factor, repeats,
                          config.get("io_threads"), config.get("recycle_files", False))
    if "baselines" in steps:
        measure_baselines(timer, case, rank, world, base, factor, repeats)
    if rank == 0:
        Path(out).write_text(json.dumps({"nbytes": case.nbytes, "tensors": case.tensors,
                                         "samples": timer.samples}))
    dist.destroy_process_group()
