"""The CUDA paths: pinned staging on a side stream, a CUDA state dict saved and loaded back onto
its device, and NVML on a real driver. Skipped where there is no CUDA device (CI); run on a GPU
machine with ``pytest tests/test_cuda.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from localckpt import LocalCheckpointManager
from localckpt.errors import CorruptShardError
from localckpt.ops import health
from localckpt.save.async_calls import AsyncCallsQueue
from localckpt.save.staging import StagingArena, plan_layout, tensor_view

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mixed_tensors() -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [
        torch.randn(1024, 1024, device="cuda", generator=g),  # 4 MiB: above the memmove size
        torch.arange(10, device="cuda", dtype=torch.int64),
        torch.randn(64, 48, device="cuda", generator=g).t(),  # not contiguous
        torch.randn(300, device="cuda", generator=g).to(torch.bfloat16),
        torch.empty(0, device="cuda"),
        torch.randn(5),  # a CPU tensor in the same save
    ]


@pytest.mark.parametrize("pin", [None, False])
def test_stage_copies_cuda_tensors_exactly(pin: bool | None) -> None:
    arena = StagingArena(pin=pin)
    tensors = _mixed_tensors()
    layout = plan_layout(tensors)
    buf = arena.stage(tensors, layout, layout.nbytes + 100)
    assert buf.is_pinned() == (pin is None)  # pinned by default when CUDA is available
    for t, offset, size in zip(tensors, layout.offsets, layout.sizes, strict=True):
        assert torch.equal(tensor_view(buf, offset, size, t.dtype, t.shape), t.cpu())
    assert not buf[layout.nbytes:].any()


def test_lazy_conjugate_and_negative_views_stage_their_values() -> None:
    z = torch.randn(1 << 20, dtype=torch.complex64, device="cuda")
    tensors = [z.conj(), z.conj().imag, torch._neg_view(torch.randn(1 << 20, device="cuda"))]
    assert tensors[0].is_conj() and tensors[1].is_neg() and tensors[2].is_neg()
    arena = StagingArena()
    layout = plan_layout(tensors)
    for _ in range(3):  # the bug this guards against was a race: not every run showed it
        buf = arena.stage(tensors, layout, layout.nbytes)
        for t, offset, size in zip(tensors, layout.offsets, layout.sizes, strict=True):
            assert torch.equal(tensor_view(buf, offset, size, t.dtype, t.shape), t.cpu())


@pytest.mark.parametrize("shape", [(2048, 2048), (64, 64)])  # copied alone; gathered
def test_stage_sees_queued_work_and_returns_a_snapshot(shape: tuple[int, int]) -> None:
    """The side stream waits for kernels already queued on the current stream, and on return the
    copy is complete: training may overwrite the tensor at once."""
    a = torch.randn(*shape, device="cuda")
    out = torch.empty_like(a)
    torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ~0.1 s on the stream
    torch.mul(a, 2, out=out)  # queued behind the sleep: not yet run when stage is called
    arena = StagingArena()
    layout = plan_layout([out])
    buf = arena.stage([out], layout, layout.nbytes)
    out.fill_(-1)  # the next training step
    torch.cuda.synchronize()
    staged = tensor_view(buf, 0, layout.sizes[0], out.dtype, out.shape)
    assert torch.equal(staged, (a * 2).cpu())


def test_many_small_cuda_tensors_are_gathered_by_dtype_and_staged_exactly() -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    tensors = []
    for i in range(400):
        t = torch.randn(1 + i % 97, device="cuda", generator=g)
        tensors.append([t, t.to(torch.bfloat16), (t * 100).long(), t > 0][i % 4])
    tensors += [torch.randn(256, 1024, device="cuda", generator=g) for _ in range(70)]  # 1 MiB
    tensors += [torch.randn(300_000, device="cuda", generator=g),  # above the gather size
                torch.randn(16, 8, device="cuda", generator=g).t(),  # not contiguous
                torch.randn(8, dtype=torch.complex64, device="cuda", generator=g).conj(),
                torch.randn(3)]
    layout = plan_layout(tensors)
    runs_by_kind: dict[tuple[str, torch.dtype], int] = {}
    for run in layout.runs:
        kind = (tensors[run[0]].device.type, tensors[run[0]].dtype)
        assert all((tensors[i].device.type, tensors[i].dtype) == kind for i in run)
        runs_by_kind[kind] = runs_by_kind.get(kind, 0) + 1
    # ~70 MiB of float32 takes two runs of at most 64 MiB; the others one each (the host
    # tensor a run of its own)
    assert runs_by_kind == {("cuda", torch.float32): 2, ("cuda", torch.bfloat16): 1,
                            ("cuda", torch.int64): 1, ("cuda", torch.bool): 1,
                            ("cpu", torch.float32): 1}
    assert sum(map(len, layout.runs)) == 471
    buf = StagingArena().stage(tensors, layout, layout.nbytes)
    for t, offset, size in zip(tensors, layout.offsets, layout.sizes, strict=True):
        assert torch.equal(tensor_view(buf, offset, size, t.dtype, t.shape), t.cpu())


def test_async_save_and_load_cuda_state_dict(root: Path) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    state = {"model": {"w": torch.randn(512, 256, device="cuda", generator=g),
                       "b": torch.randn(256, device="cuda", generator=g).to(torch.bfloat16)},
             "small": [torch.full((4,), float(i), device="cuda") for i in range(300)],
             "cpu": torch.arange(7), "step": 11}
    expected = {"w": state["model"]["w"].cpu(), "b": state["model"]["b"].cpu()}
    with LocalCheckpointManager(root, "s") as mgr:
        req = mgr.save(state, 1, is_async=True)
        state["model"]["w"].zero_()  # training goes on while the save runs
        queue = AsyncCallsQueue(timeout=60)
        queue.schedule_async_request(req)  # type: ignore[arg-type]
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        queue.close()
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, ckpt_id = mgr.load()
    assert ckpt_id == (1, 0, "s")
    w, b = loaded["model"]["w"], loaded["model"]["b"]
    assert w.device == b.device == torch.device("cuda", torch.cuda.current_device())
    assert torch.equal(w.cpu(), expected["w"]) and torch.equal(b.cpu(), expected["b"])
    assert b.dtype == torch.bfloat16
    assert [t.item() for t in (x[0] for x in loaded["small"])] == [float(i) for i in range(300)]
    assert all(x.is_cuda for x in loaded["small"])
    # moved to the GPU together, yet each in a storage of its own
    assert len({x.untyped_storage().data_ptr() for x in loaded["small"]}) == 300
    assert loaded["cpu"].device.type == "cpu" and loaded["step"] == 11


def test_an_async_save_snapshots_large_tensors_copied_as_the_walk_meets_them(root: Path) -> None:
    """From the second save on, large CUDA tensors are copied while the state dict is walked:
    the copies still come after the work queued on them, and training that goes on after the
    stall does not reach the snapshot."""
    big = [torch.randn(4 << 20, device="cuda") for _ in range(3)]  # 16 MiB each
    state = {"small": torch.arange(10, device="cuda"), "big": big}
    with LocalCheckpointManager(root, "s", keep_last=1) as mgr:
        queue = AsyncCallsQueue()
        mgr.save(state, 1)  # sizes the arena: the next saves copy early
        for it in (2, 3, 4):
            for t in big:  # queued on the current stream just before the save
                t.mul_(2).add_(1)
            expected = [t.clone() for t in big]
            req = mgr.save(state, it, is_async=True)
            for t in big:  # training goes on
                t.fill_(-1)
            queue.schedule_async_request(req)  # type: ignore[arg-type]
            queue.maybe_finalize_async_calls(blocking=True)
            loaded, _ = mgr.load()
            assert all(torch.equal(a, b) for a, b in zip(expected, loaded["big"], strict=True))
            assert torch.equal(loaded["small"], state["small"])
        queue.close()
        store = mgr._ctx.store
        entries = {e.key_path: e.offset for e in store.read_manifest(store.ref(4, 0, 1)).tensors}
    assert entries["big/0"] == 0  # copied early: placed first, ahead of the gathered run


def test_a_tensor_a_stateful_makes_after_an_early_copy_is_staged_after_its_kernel(
        root: Path) -> None:
    """The walk runs a Stateful's state_dict() after a large tensor was already copied early;
    the tensor it returns is made by a kernel queued then (here behind a 100 ms sleep on the
    GPU): its copy must wait for that kernel, not only for what was queued before the walk."""
    first = torch.randn(4 << 20, device="cuda")
    w = torch.randn(4 << 20, device="cuda")

    class Doubled:
        def state_dict(self) -> dict[str, torch.Tensor]:
            torch.cuda._sleep(200_000_000)  # type: ignore[attr-defined]
            return {"w": w * 2}

        def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
            pass

    with LocalCheckpointManager(root, "s") as mgr:
        for it in (1, 2, 3):  # from the second save on, "first" is copied early
            mgr.save({"first": first, "doubled": Doubled()}, it)
            back, _ = mgr.load()
            assert torch.equal(back["doubled"]["w"], w * 2), it


def test_nvml_inventory_names_the_gpus() -> None:
    pytest.importorskip("pynvml")
    status, gpus = health.gpu_inventory()
    assert status == "ok"
    assert len(gpus) >= torch.cuda.device_count()
    assert all(g.name and g.uuid.startswith("GPU-") and g.memory_total_bytes > 0 for g in gpus)


def test_load_into_cuda_tensors_fills_the_callers_own(root: Path) -> None:
    saved = {"w": torch.randn(512, 256, device="cuda"), "small": torch.arange(7, device="cuda"),
             "cpu": torch.randn(9)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    into = {k: torch.zeros_like(v) for k, v in saved.items()}
    into["w"] = torch.nn.Parameter(into["w"])  # requires grad: filled all the same
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    for k, v in saved.items():
        assert loaded[k] is into[k] and loaded[k].device == v.device
        assert torch.equal(loaded[k].detach(), v)


# ------------------------------------------------------------- loads through pinned memory

def _pinned_state() -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(3)
    return {
        "big": torch.randn(300_000, device="cuda", generator=g),  # 1.2 MB: many 64 KiB chunks
        "small": [torch.randn(1 + i % 53, device="cuda", generator=g).to(dtype)
                  for i, dtype in zip(range(400), [torch.float32, torch.bfloat16,
                                                   torch.int64, torch.bool] * 100, strict=True)],
        "scalar": torch.tensor(2.5, device="cuda"),
        "empty": torch.empty(0, 3, device="cuda"),
        "cpu": torch.randn(1000),
        "step": 7,
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.device == b.device and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("spare_slots", [2, -1])  # -1: one slot shared by both readers
def test_load_reads_through_pinned_slots_straight_onto_the_device(
        root: Path, monkeypatch: pytest.MonkeyPatch, spare_slots: int) -> None:
    from localckpt import state_dict
    from localckpt.storage import device_reader, store

    state = _pinned_state()
    with LocalCheckpointManager(root, "s", chunk_nbytes=64 << 10, io_threads=2) as mgr:
        mgr.save(state, 1)
    monkeypatch.setattr(store, "SPARE_SLOTS", spare_slots)
    copies: list[int] = []  # pieces per chunk copied out of a slot
    real_copy_out = device_reader.DeviceScatter.copy_out

    def copy_out(self: device_reader.DeviceScatter, slot: object, chunk: int) -> None:
        copies.append(len(self._per_chunk.get(chunk, [])))
        real_copy_out(self, slot, chunk)  # type: ignore[arg-type]

    monkeypatch.setattr(device_reader.DeviceScatter, "copy_out", copy_out)
    crossed: list[str] = []  # tensors restore_devices still had to move off the CPU
    real_restore = state_dict.restore_devices

    def restore(tensors: list[torch.Tensor], devices: list[str], skip: object = ()) -> object:
        crossed.extend(d for i, (t, d) in enumerate(zip(tensors, devices, strict=True))
                       if t.is_cpu and d.startswith("cuda") and t.numel())
        return real_restore(tensors, devices, skip)  # type: ignore[arg-type]

    monkeypatch.setattr(state_dict, "restore_devices", restore)
    with LocalCheckpointManager(root, "s", io_threads=2) as mgr:
        loaded, _ = mgr.load()
    assert _same(loaded, state)
    assert crossed == []  # no pageable hop
    assert max(copies) > 4 and min(copies) <= 4  # scattered on the device; copied piece by piece
    storages = {t.untyped_storage().data_ptr() for t in loaded["small"]}  # type: ignore[union-attr]
    assert len(storages) == 400


def test_a_corrupt_chunk_read_through_pinned_memory_falls_back(root: Path) -> None:
    old, new = _pinned_state(), _pinned_state()
    new["big"] = new["big"] + 1

    def corrupt(iteration: int) -> Path:
        chunk = root / "s" / f"iter_{iteration:010d}" / "rank_00000_of_00001" / "data" / "c" / "3"
        raw = bytearray(chunk.read_bytes())
        raw[5] ^= 0x10
        chunk.write_bytes(raw)
        return chunk

    with LocalCheckpointManager(root, "s", keep_last=2, chunk_nbytes=64 << 10) as mgr:
        mgr.save(old, 1)
        mgr.save(new, 2)
    corrupt(2)
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        loaded, ckpt_id = mgr.load()  # the newest fails its checksum: the older one, same load
    assert ckpt_id[0] == 1 and _same(loaded, old)
    with LocalCheckpointManager(root, "s", keep_last=2, chunk_nbytes=64 << 10) as mgr:
        mgr.save(new, 3)
    chunk = corrupt(3)
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr, \
            pytest.raises(CorruptShardError, match="checksum mismatch") as info:
        mgr.load(iteration=3)
    assert str(chunk) in str(info.value)


def test_load_into_cuda_tensors_reads_into_them_through_pinned_memory(root: Path) -> None:
    saved = _pinned_state()
    with LocalCheckpointManager(root, "s", chunk_nbytes=64 << 10) as mgr:
        mgr.save(saved, 1)
    into = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor)
                else [torch.zeros_like(x) for x in v] if isinstance(v, list) else v)
            for k, v in saved.items()}
    pointers = {k: v.data_ptr() for k, v in into.items() if isinstance(v, torch.Tensor)}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    assert _same(loaded, saved)
    assert {k: v.data_ptr() for k, v in loaded.items() if isinstance(v, torch.Tensor)} \
        == pointers
    assert all(a is b for a, b in zip(loaded["small"], into["small"], strict=True))


def test_a_corrupt_own_copy_on_the_gpu_is_replaced_by_the_peers_replica(tmp_path: Path) -> None:
    import cuda_scenarios
    from dist_harness import run_ranks

    results = run_ranks(cuda_scenarios.own_copy_corrupt_then_load, 2, tmp_path,
                        str(tmp_path / "nodes"), deadline=180)
    for r in results:
        assert r.error is None, r.error
    zero, one = (r.value for r in results)
    assert zero["ckpt_id"][0] == one["ckpt_id"][0] == 1
    assert zero["same"] and one["same"]
    assert zero["devices"] == one["devices"] == ["cuda:0"]
    assert len(zero["quarantined"]) == 1 and not one["quarantined"]


def test_an_entry_filled_by_a_copy_is_read_into_host_memory_not_a_second_device_tensor(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localckpt.storage import store

    saved = {"conv": torch.randn(16, 8, 4, 4, device="cuda"), "b": torch.randn(100, device="cuda")}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    into = {"conv": torch.zeros(16, 8, 4, 4, device="cuda").to(memory_format=torch.channels_last),
            "b": torch.zeros(100, device="cuda")}
    fresh: list[str] = []
    real = store.read_shard_tensors

    def spy(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        out = real(*args, **kwargs)
        fresh.extend(str(t.device) for t in out)
        return out

    monkeypatch.setattr(store, "read_shard_tensors", spy)
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    assert loaded["conv"] is into["conv"] and torch.equal(loaded["conv"], saved["conv"])
    assert loaded["b"] is into["b"] and torch.equal(loaded["b"], saved["b"])
    assert fresh == ["cpu", "cuda:0"]  # the channels_last one through the host, "b" read into
