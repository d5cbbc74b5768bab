"""Rank functions for tests/test_dtensor.py: the FSDP2 x TP model of scripts/fsdp2_example.py on
a (dp=2, tp=2) mesh, 4 gloo ranks on 2 simulated nodes (ranks 0-1 on node0, 2-3 on node1)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from fsdp2_example import AppState, TokenLoader, build, train_step
from scenarios import digest

from localckpt import LocalCheckpointManager

CPU = torch.device("cpu")


def _mesh(tp: int = 2) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))


def _job(mesh: Any) -> tuple[Any, Any, Any, TokenLoader, AppState]:
    model = build(mesh, CPU)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))
    loader = TokenLoader(seed=7, dp_rank=mesh["dp"].get_local_rank())
    return model, optim, sched, loader, AppState(model, optim, sched, loader)


def _manager(rank: int, base: str, metrics: Any = None, reshard: bool = False
             ) -> LocalCheckpointManager:
    node = rank // 2
    return LocalCheckpointManager(Path(base) / f"node{node}", "fsdp", "node_spread",
                                  timeout=30, chunk_nbytes=8192, node_id=f"node{node}",
                                  metrics=metrics, reshard=reshard)


def _local_digest(state: Any) -> str:
    """Digest of a state dict with every DTensor replaced by its local shard (bit-exact)."""
    from torch.distributed.tensor import DTensor

    def local(x: Any) -> Any:
        if isinstance(x, DTensor):
            return {"local": x.to_local(), "placements": [str(p) for p in x.placements],
                    "shape": list(x.shape)}
        if isinstance(x, dict):
            return {k: local(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [local(v) for v in x]
        return x
    return digest(local(state))


def _what(app: AppState, via: str, rng: torch.Tensor) -> dict[str, Any]:
    if via == "app":
        return {"app": app, "rng": rng}
    return {"model": app.model, "optim": app.optim, "sched": app.sched, "loader": app.loader,
            "rng": rng}


def save_and_resume(rank: int, world: int, base: str, via: str, wipe_node: int
                    ) -> dict[str, Any]:
    """Train 3 steps, save (``via``: an AppState through get_state_dict, or the model, optimizer,
    scheduler and loader objects themselves), train 3 more; then a fresh job (new model and
    optimizer, no optimizer state) loads into its objects, after ``wipe_node``'s root is wiped
    (-1: none), and trains the same 3 steps."""
    mesh = _mesh()
    model, optim, sched, loader, app = _job(mesh)
    for _ in range(3):
        train_step(model, optim, sched, loader.next(CPU))
    saved = _local_digest(app.state_dict())
    rng = torch.get_rng_state()
    with _manager(rank, base) as mgr:
        mgr.save(_what(app, via, rng), 3)
    reference = [train_step(model, optim, sched, loader.next(CPU)) for _ in range(3)]
    dist.barrier()
    if rank // 2 == wipe_node and rank % 2 == 0:
        shutil.rmtree(Path(base) / f"node{wipe_node}")
    dist.barrier()

    model, optim, sched, loader, app = _job(mesh)
    fetched: list[int] = []

    def hook(m: Any) -> None:
        if m.phase == "fetch_from_peer":
            fetched.append(m.nbytes)

    into = _what(app, via, torch.zeros_like(rng))
    with _manager(rank, base, hook) as mgr:
        state, ckpt = mgr.load(into=into)
        mgr.wait_for_write_back()
    in_place = all(state[k] is into[k] for k in into if k != "rng") and state["rng"] is into["rng"]
    loaded = _local_digest(app.state_dict())
    resumed = [train_step(model, optim, sched, loader.next(CPU)) for _ in range(3)]
    return {"ckpt": list(ckpt), "in_place": in_place, "identical": loaded == saved,
            "rng": torch.equal(state["rng"], rng), "reference": reference, "resumed": resumed,
            "position": loader.position, "fetched": sum(fetched),
            "healed": (Path(base) / f"node{rank // 2}" / "fsdp").is_dir()}


def refusals(rank: int, world: int, base: str) -> dict[str, Any]:
    """What a DTensor checkpoint refuses, each the same error on every rank, and that nothing
    committed is lost by it."""
    from torch.distributed.tensor import DTensor, Partial

    out: dict[str, Any] = {}
    mesh = _mesh()

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = "ok"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    model, optim, sched, loader, app = _job(mesh)
    train_step(model, optim, sched, loader.next(CPU))
    with _manager(rank, base) as mgr:
        partial = DTensor.from_local(torch.ones(3), mesh["dp"], [Partial()])
        attempt("partial", lambda: mgr.save({"grad_sum": partial}, 1))
        mgr.save({"app": app}, 2)
        attempt("no_into", lambda: mgr.load())
    other = _mesh(tp=1)  # the same world on another mesh: (4, 1)
    _, _, _, _, elsewhere = _job(other)
    with _manager(rank, base) as mgr:
        attempt("other_mesh", lambda: mgr.load(into={"app": elsewhere}))
    with _manager(rank, base, reshard=True) as mgr:  # the same world, resharded
        _, ckpt = mgr.load(into={"app": elsewhere})
    out["resharded"] = list(ckpt)
    out["resharded_identical"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), elsewhere.model.parameters(), strict=True))
    _, _, _, _, fresh = _job(mesh)
    with _manager(rank, base) as mgr:
        _, ckpt = mgr.load(into={"app": fresh})
    out["after"] = list(ckpt)
    out["identical"] = _local_digest(fresh.state_dict()) == _local_digest(app.state_dict())
    return out


class GlobalLoader:
    """The batch of a step is the same for any data-parallel degree: each dp rank takes its
    rows of it (what an elastic job needs to resume on another world size)."""

    def __init__(self, dp_rank: int, dp: int) -> None:
        self.dp_rank, self.dp, self.position = dp_rank, dp, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        return torch.randint(0, 64, (8, 17), generator=g)[self.dp_rank::self.dp]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def _elastic_job(world: int) -> tuple[Any, Any, Any, GlobalLoader, AppState]:
    mesh = _mesh()
    model = build(mesh, CPU)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))
    loader = GlobalLoader(mesh["dp"].get_local_rank(), world // 2)
    return model, optim, sched, loader, AppState(model, optim, sched, loader)  # type: ignore[arg-type]


def _global_step(job: tuple[Any, ...], world: int) -> float:
    model, optim, sched, loader, _ = job
    loss = torch.tensor([train_step(model, optim, sched, loader.next())], dtype=torch.float64)
    dist.all_reduce(loss)  # the tp ranks of a dp rank agree: the mean over dp ranks
    return float(loss.item()) / world


def _elastic_manager(rank: int, world: int, base: str) -> LocalCheckpointManager:
    node = rank // (world // 2)
    return LocalCheckpointManager(Path(base) / f"node{node}", "elastic", "node_spread",
                                  timeout=30, chunk_nbytes=8192, node_id=f"node{node}",
                                  reshard=True)


def elastic_save(rank: int, world: int, base: str) -> list[float]:
    """Train 3 steps on (world/2, 2), save at 3, then train 3 more: the reference curve."""
    job = _elastic_job(world)
    for _ in range(3):
        _global_step(job, world)
    with _elastic_manager(rank, world, base) as mgr:
        mgr.save({"app": job[4], "rank": rank}, 3)
    return [_global_step(job, world) for _ in range(3)]


def elastic_resume(rank: int, world: int, base: str, corrupt: int = -1) -> dict[str, Any]:
    """A job of another world size resumes from iteration 3, trains 3 steps, saves at 6.
    ``corrupt``: the old owner whose copy gets a flipped byte first (-1: none): the copy its
    server reads (with every old shard on both nodes, owner o is served by rank o % world,
    whose root is node o % 2 in a world of 2)."""
    if rank == 0 and corrupt >= 0:
        shard = next((Path(base) / f"node{corrupt % 2}" / "elastic" / "iter_0000000003").glob(
            f"rank_{corrupt:05d}_of_*"))
        chunk = shard / "data" / "c" / "0"
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))
    dist.barrier()
    job = _elastic_job(world)
    with _elastic_manager(rank, world, base) as mgr:
        latest = mgr.find_latest()
        state, ckpt = mgr.load(into={"app": job[4], "rank": -1})
        quarantined = sorted(p.name for n in (0, 1) for p in
                             (Path(base) / f"node{n}" / "elastic").glob(".quarantine-*"))
        resumed = [_global_step(job, world) for _ in range(3)]
        mgr.save({"app": job[4], "rank": rank}, 6)
        again = mgr.find_latest()
    return {"latest": latest, "ckpt": list(ckpt), "position": job[3].position - 3,
            "plain_from": state["rank"], "in_place": state["app"] is job[4],
            "resumed": resumed, "again": again, "quarantined": quarantined}


def _mixed_state(world: int) -> dict[str, Any]:
    """DTensors of mixed dtypes on a 1-D mesh (uneven shards, a replicated one, a 0-dim one)
    and plain scalars of mixed widths: what a resharding load must place byte-exactly."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh1d(world)
    g = torch.Generator().manual_seed(5)
    full = {"w16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "w32": torch.randn(7000, generator=g), "w64": torch.randn(6, 2, generator=g).double(),
            "rep": torch.arange(3, dtype=torch.int32), "zero": torch.tensor(2.5)}
    state: dict[str, Any] = {k: distribute_tensor(v, mesh, [Replicate()] if k in ("rep", "zero")
                                                   else [Shard(0)]) for k, v in full.items()}
    state |= {"s32": torch.tensor(1.5), "i64": torch.tensor(7), "flag": torch.tensor(True)}
    return state


def _mesh1d(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def _mixed_manager(base: str) -> LocalCheckpointManager:
    return LocalCheckpointManager(Path(base) / "root", "mixed", None, timeout=30,
                                  chunk_nbytes=4096, node_id="one", reshard=True)


def mixed_save(rank: int, world: int, base: str) -> None:
    with _mixed_manager(base) as mgr:
        mgr.save({**_mixed_state(world), "rank": rank}, 3)


def mixed_load(rank: int, world: int, base: str, round_nbytes: int = 0) -> dict[str, Any]:
    """Load the mixed state saved by another world size into zeros on this one; then a
    rejected save must not lose the loadable checkpoint, and a save not newer than the loaded
    iteration is refused (it would be shadowed by it on the next start). ``round_nbytes``: the
    all-to-all moves at most that many bytes per rank and round (several rounds)."""
    from torch.distributed.tensor import DTensor

    import localckpt.load.reshard as reshard
    from localckpt.storage.manifest import dtype_from_name

    if round_nbytes:
        reshard.ROUND_NBYTES = round_nbytes
        calls: list[int] = []
        real = reshard.dist.all_to_all_single

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return real(*args, **kwargs)
        reshard.dist.all_to_all_single = counted  # type: ignore[assignment]

    held: list[tuple[int, int]] = []  # (bytes of memory kept for its own pieces, their bytes)
    build = reshard._build

    def spy(manifest: Any, incoming: Any, manifests: Any, received: Any, own: Any,
            rank: int, *args: Any) -> Any:
        mine = 0
        for p in incoming.get(rank, []):  # padded as in the buffers
            e = manifests[p.owner].tensors[p.entry]
            n = e.nbytes if p.entry not in manifests[p.owner].layouts else \
                torch.Size(p.size).numel() * dtype_from_name(e.dtype).itemsize
            mine += -(-n // reshard.ALIGN) * reshard.ALIGN
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in own.values()}
        held.append((sum(storages.values()), mine))
        return build(manifest, incoming, manifests, received, own, rank, *args)
    reshard._build = spy  # type: ignore[assignment]

    want = _mixed_state(world)
    into = {k: (DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements,
                                   shape=v.shape, stride=v.stride())
                if isinstance(v, DTensor) else torch.zeros_like(v)) for k, v in want.items()}
    out: dict[str, Any] = {}
    with _mixed_manager(base) as mgr:
        try:
            mgr.save({"x": torch.ones(1)}, -5)
        except Exception as exc:
            out["rejected"] = type(exc).__name__
        state, ckpt = mgr.load(into={**into, "rank": -1})
        out["ckpt"] = list(ckpt)
        out["exact"] = {k: bool(torch.equal(
            (state[k].full_tensor() if isinstance(state[k], DTensor) else state[k]).view(-1)
            .view(torch.uint8),
            (v.full_tensor() if isinstance(v, DTensor) else v).view(-1).view(torch.uint8)))
            for k, v in want.items()}
        out["in_place"] = all(state[k] is into[k] for k in want if isinstance(want[k], DTensor))
        out["plain_from"] = state["rank"]
        try:
            mgr.save({"x": torch.ones(1)}, 2)
        except Exception as exc:
            out["older"] = f"{type(exc).__name__}: {exc}"
        mgr.save({"x": torch.ones(1)}, 4)
        out["after"] = mgr.find_latest()
    if round_nbytes:
        out["rounds"] = len(calls)
    out["own_held"] = held
    return out


def _hsdp_job() -> tuple[Any, ...]:
    """HSDP: FSDP2 over a (replicate=2, shard=2) mesh; every parameter and optimizer state is
    Replicate on dim 0, Shard(0) on dim 1."""
    from fsdp2_example import TinyTransformer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = TinyTransformer()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    loader = GlobalLoader(dist.get_rank(), dist.get_world_size())
    return model, optim, sched, loader, AppState(model, optim, sched, loader)  # type: ignore[arg-type]


def _hsdp_manager(rank: int, base: str, session: str, dedupe: bool) -> LocalCheckpointManager:
    node = rank // 2
    return LocalCheckpointManager(Path(base) / f"node{node}", session, "node_spread",
                                  timeout=30, chunk_nbytes=8192, node_id=f"node{node}",
                                  dedupe_replicated=dedupe)


def hsdp_dedupe(rank: int, world: int, base: str) -> dict[str, Any]:
    """Save HSDP state with and without dedupe (bytes per rank), train on (the reference), then
    wipe node 1 and load the deduplicated checkpoint into a fresh job: identical state, the
    same losses."""
    from localckpt.save import dedupe

    dedupe.MIN_NBYTES = 0  # this model's shards are tiny
    job = _hsdp_job()
    for _ in range(2):
        _global_step(job, world)
    saved = _local_digest(job[4].state_dict())
    sizes = {}
    for session, on in (("dedupe", True), ("full", False)):
        with _hsdp_manager(rank, base, session, on) as mgr:
            mgr.save({"app": job[4]}, 2)
            store = mgr._ctx.store
            own = store.read_manifest(store.ref(2, rank, world))
            sizes[session] = own.data_nbytes
            sizes[f"{session}_version"] = own.format_version
    reference = [_global_step(job, world) for _ in range(2)]
    dist.barrier()
    if rank == 2:
        shutil.rmtree(Path(base) / "node1")
    dist.barrier()
    job = _hsdp_job()
    with _hsdp_manager(rank, base, "dedupe", True) as mgr:
        state, ckpt = mgr.load(into={"app": job[4]})
        mgr.wait_for_write_back()
    return {"sizes": sizes, "ckpt": list(ckpt), "in_place": state["app"] is job[4],
            "identical": _local_digest(job[4].state_dict()) == saved,
            "resumed": [_global_step(job, world) for _ in range(2)],
            "reference": reference}


def non_spmd_replicas(rank: int, world: int, base: str) -> dict[str, Any]:
    """Rank 1 alone holds a replicated DTensor whose keeper would be rank 0: the save is refused
    on every rank (nothing written), and saves without it go on."""
    from torch.distributed.tensor import DTensor, Replicate

    from localckpt.save import dedupe

    dedupe.MIN_NBYTES = 0
    mesh = _mesh1d(world)
    both = DTensor.from_local(torch.arange(4.0), mesh, [Replicate()], run_check=False)
    state: dict[str, Any] = {"both": both}
    if rank == 1:  # crc32("odd1") % 2 == 0: rank 0 would be its keeper
        state["odd1"] = DTensor.from_local(torch.ones(3), mesh, [Replicate()], run_check=False)
    out: dict[str, Any] = {}
    with _mixed_manager(base) as mgr:
        mgr.save({"both": both}, 1)
        try:
            mgr.save(state, 2)
        except Exception as exc:
            out["refused"] = f"{type(exc).__name__}: {exc}"
        out["latest"] = mgr.find_latest()
        mgr.save({"both": both}, 3)
        out["after"] = mgr.find_latest()
    return out


def dedupe_corrupt(rank: int, world: int, base: str, strategy: str | None,
                   exact: int | None = None) -> dict[str, Any]:
    """Two replicated leaves, each stored by one of 2 ranks (one node each); iterations 1 and 2
    kept; rank 0's copy of iteration 2 damaged. The load reads it only through the resharding
    path: it must quarantine it and take the replica (``strategy``), or iteration 1 (None).
    ``exact``: ``load(iteration=exact)``, which never takes another iteration."""
    from torch.distributed.tensor import DTensor, Replicate

    from localckpt.save import dedupe

    dedupe.MIN_NBYTES = 0
    mesh = _mesh1d(world)

    def state(it: int) -> dict[str, Any]:  # crc32 % 2: "odd1" -> rank 0, "odd" -> rank 1
        return {k: DTensor.from_local(torch.full((64,), float(it * 10 + j)), mesh,
                                      [Replicate()], run_check=False)
                for j, k in enumerate(("odd1", "odd"))}

    def manager() -> LocalCheckpointManager:
        return LocalCheckpointManager(Path(base) / f"node{rank}", "dc", strategy, keep_last=2,
                                      timeout=30, chunk_nbytes=4096, node_id=f"node{rank}")

    with manager() as mgr:
        mgr.save(state(1), 1)
        mgr.save(state(2), 2)
    dist.barrier()
    if rank == 0:
        chunk = next((Path(base) / "node0" / "dc" / "iter_0000000002").glob(
            "rank_00000_of_*")) / "data" / "c" / "0"
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))
    dist.barrier()
    into = {k: DTensor.from_local(torch.zeros(64), mesh, [Replicate()], run_check=False)
            for k in ("odd1", "odd")}
    with manager() as mgr:
        try:
            loaded, ckpt = mgr.load(into=into, iteration=exact)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    return {"ckpt": list(ckpt),
            "values": {k: sorted(set(v.to_local().tolist())) for k, v in loaded.items()}}


def duplicate_dtensor_paths(rank: int, world: int, base: str) -> str:
    """Two DTensors whose key paths coincide ("a/b" and "a" -> "b"): refused by save."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = _mesh1d(world)
    leaf = DTensor.from_local(torch.ones(4), mesh, [Replicate()], run_check=False)
    with _mixed_manager(base) as mgr:
        try:
            mgr.save({"a/b": leaf, "a": {"b": leaf * 2}}, 1)
        except TypeError as exc:
            return str(exc)
    return "saved"


def _flat_manager(base: str) -> LocalCheckpointManager:
    return LocalCheckpointManager(Path(base), "flat", None, chunk_nbytes=4096, node_id="one",
                                  reshard=True, timeout=20)


def flat_save(rank: int, world: int, base: str, n: int = 16) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    with _flat_manager(base) as mgr:
        mgr.save({"flat": distribute_tensor(torch.arange(float(n)), mesh, [Shard(0)])}, 1)


def flat_load(rank: int, world: int, base: str) -> dict[str, Any]:
    """``into``: a (Shard(0), Shard(1)) 4x4 parameter seen flat, as ``view(-1)`` makes it:
    (Shard(0), _StridedShard(0, split_factor=2)), each rank's shard four elements that are
    not one block of the flat tensor (rank (0, 0): 0, 1, 4, 5)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    flat = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0), Shard(1)]).view(-1)
    with _flat_manager(base) as mgr:
        try:
            state, _ = mgr.load(into={"flat": flat})
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        full = state["flat"].full_tensor()
        return {"error": None, "equal": torch.equal(full, torch.arange(16.0))}


def flat_corrupt_load(rank: int, world: int, base: str) -> str:
    """After flat_save at another world size: rank 0 damages the only copy of old shard 0, then
    every rank loads resharded. What every rank raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if rank == 0:
        chunk = next(Path(base).glob("flat/iter_*/rank_00000_of_*/data/c/0"))
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    into = {"flat": distribute_tensor(torch.zeros(16), mesh, [Shard(0)])}
    with _flat_manager(base) as mgr:
        try:
            mgr.load(into=into)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return "loaded"


def flat_load_with(rank: int, world: int, base: str, fault: str, timeout: float,
                   n: int = 16) -> str:
    """A resharding load of flat_save's checkpoint (saved by 1 rank, ``n`` elements) at
    ``world`` ranks with a fault: "slow_read" (a whole-shard read takes 2 timeouts: a shard of
    several messages, of 4 KiB here, on a slow disk), "no_memory" (rank 1 cannot allocate what
    it receives) or "damaged_in_transit" (a byte rank 1 receives is flipped, once). What each
    rank got."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import localckpt.load.reshard as reshard
    from localckpt.storage.store import ShardStore

    if fault == "slow_read":
        import localckpt.storage.shard_stream as stream

        stream.STREAM_PIECE_NBYTES = 4096  # the shard is several messages on the wire
        real_read = ShardStore.read

        def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
            time.sleep(2 * timeout)
            return real_read(self, *args, **kwargs)
        ShardStore.read = slow  # type: ignore[method-assign]
    if fault == "damaged_in_transit" and rank == 1:
        real_all_to_all, damaged = reshard.dist.all_to_all_single, []

        def damaging(output: Any, *args: Any, **kwargs: Any) -> Any:
            out = real_all_to_all(output, *args, **kwargs)
            if not damaged and output.numel():
                output[output.numel() // 2] ^= 0x10  # once: the next attempt arrives intact
                damaged.append(1)
            return out
        reshard.dist.all_to_all_single = damaging
    if fault == "no_memory" and rank == 1:
        real_empty, calls = reshard.empty_host, []

        def empty_host(shape: Any, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
            if isinstance(shape, int):  # a byte buffer: the send buffer first, then the receive
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
            return real_empty(shape, dtype)
        reshard.empty_host = empty_host  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    into = {"flat": distribute_tensor(torch.zeros(n), mesh, [Shard(0)])}
    with LocalCheckpointManager(Path(base), "flat", None, chunk_nbytes=4096, node_id="one",
                                reshard=True, timeout=timeout) as mgr:
        try:
            state, _ = mgr.load(into=into)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        full = state["flat"].full_tensor()
        return "loaded" if torch.equal(full, torch.arange(float(n))) else "wrong"
