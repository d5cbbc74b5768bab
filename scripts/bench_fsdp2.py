"""bench.py's ``fsdp2`` case: the state of an FSDP2 x tensor-parallel transformer saved and loaded
by localckpt and by torch.distributed.checkpoint (DCP), to the same tmpfs, on the same ranks.

The model is scripts/fsdp2_example.py's on a (dp = world / 2, tp = 2) mesh: its DTensor
parameters plus AdamW's state (``exp_avg``, ``exp_avg_sq``, ``step``), wrapped in that script's
``AppState`` (``get_state_dict`` / ``set_state_dict``), which both libraries take as a Stateful.
Both sides do the same work: a save of ``{"app": app}`` that has returned is on tmpfs (localckpt:
synchronous, no replication, so the same bytes as DCP, by the job's one manager, its staging
memory reserved); a load is into a freshly built job's
objects (DCP: ``dcp.load({"app": app})``; localckpt: ``find_latest`` + ``load(into=...)``).
Then both load the same checkpoint onto another mesh of the same ranks, (world, 1): FSDP2 over
all of them, no tensor parallelism (localckpt: ``reshard=True``; DCP reshards by itself).
Raw limits from the same job: memcpy, tmpfs write (fresh file + fsync) and read into
preallocated memory of one rank's bytes.
"""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_rank import Timer, raw_read, raw_write
from fsdp2_example import AppState, TokenLoader, build
from torch.distributed.device_mesh import init_device_mesh

from localckpt import LocalCheckpointManager

CPU = torch.device("cpu")


def _job(mesh: Any, sizes: dict[str, int]) -> AppState:
    """A freshly built job: the model, AdamW with its state allocated (as after a first step),
    the schedule, the loader."""
    model = build(mesh, CPU, **sizes)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    app = AppState(model, optim, sched, TokenLoader(seed=1, dp_rank=0))
    app.state_dict()  # get_state_dict allocates the optimizer's state, as a first step would
    return app


def _local_bytes(state: Any) -> tuple[int, int]:
    """(bytes, tensors) this rank holds of ``state``: DTensors count their local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return _local_bytes(state.to_local())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size(), 1
    values = state.values() if isinstance(state, dict) else \
        state if isinstance(state, (list, tuple)) else ()
    sizes = [_local_bytes(v) for v in values]
    return sum(s for s, _ in sizes), sum(n for _, n in sizes)


def measure(rank: int, store_path: str, base_dir: str, out: str, config: dict[str, Any]) -> None:
    """Entry point of a spawned rank (see bench.py)."""
    torch.set_num_threads(1)
    world, repeats = config["world"], config["repeats"]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=900))
    base = Path(base_dir)
    base.mkdir(parents=True, exist_ok=True)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    ca = config["case_args"]
    sizes = {"vocab": ca["vocab"], "dim": ca["d_model"], "layers": ca["layers"],
             "heads": max(2, ca["d_model"] // 64)}
    app = _job(mesh, sizes)
    nbytes, tensors = _local_bytes(app.state_dict())
    timer = Timer()

    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(payload)
    path = base / f"raw{rank}.bin"
    for _ in range(repeats):
        timer.run("memcpy", lambda: dst.copy_(payload))
        timer.run("tmpfs_write_fresh", lambda: raw_write(path, memoryview(payload.numpy())),
                  lambda: path.unlink(missing_ok=True))
        timer.run("tmpfs_read", lambda: raw_read(path, memoryview(dst.numpy())))
    path.unlink(missing_ok=True)

    node = rank // (world // 2)
    root = base / f"node{node}"
    dcp_dir = base / "dcp"  # one directory every rank sees, as DCP needs
    # One manager saves, as in a job (its staging memory reserved once); each load is a new
    # manager's, as after a restart.
    saver = LocalCheckpointManager(root, "bench", None, timeout=900, node_id=f"node{node}",
                                   io_threads=config.get("io_threads"))
    saver.reserve({"app": app})
    for it in range(1, repeats + 1):
        timer.run("localckpt_save", lambda i=it: saver.save({"app": app}, i))
        fresh = _job(mesh, sizes)
        with LocalCheckpointManager(root, "bench", None, timeout=900, node_id=f"node{node}",
                                    io_threads=config.get("io_threads")) as mgr:
            timer.run("localckpt_load_into",
                      lambda m=mgr, f=fresh: (m.find_latest(), m.load(into={"app": f})))
        if rank == 0:
            shutil.rmtree(dcp_dir, ignore_errors=True)
        dist.barrier()
        timer.run("dcp_save", lambda: dcp.save({"app": app}, checkpoint_id=str(dcp_dir)))
        fresh = _job(mesh, sizes)
        timer.run("dcp_load", lambda f=fresh: dcp.load({"app": f}, checkpoint_id=str(dcp_dir)))
        del fresh
    saver.close()
    # Resharding: the same state loaded onto another mesh of the same ranks, (world, 1): FSDP2
    # over all ranks, no tensor parallelism (localckpt with reshard=True; DCP reshards itself).
    other = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    for _ in range(repeats):
        fresh = _job(other, sizes)
        with LocalCheckpointManager(root, "bench", None, timeout=900, node_id=f"node{node}",
                                    io_threads=config.get("io_threads"),
                                    reshard=True) as mgr:
            timer.run("localckpt_load_resharded",
                      lambda m=mgr, f=fresh: (m.find_latest(), m.load(into={"app": f})))
        fresh = _job(other, sizes)
        timer.run("dcp_load_resharded",
                  lambda f=fresh: dcp.load({"app": f}, checkpoint_id=str(dcp_dir)))
        del fresh
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"nbytes": nbytes, "tensors": tensors,
                                         "samples": timer.samples}))
        shutil.rmtree(dcp_dir, ignore_errors=True)
    if rank % (world // 2) == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
