"""The pinned-memory load path's logic, on any machine: DeviceScatter and read_chunks_into with a
stand-in for torch.cuda (streams and events that record what they are asked, host tensors for
device ones), the device destinations of ``match``, and the failure paths that must leave no copy
running. What only a GPU shows (real streams, pinned memory) is in tests/test_cuda.py."""

from __future__ import annotations

import random
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from localckpt.errors import CorruptShardError
from localckpt.load import restore
from localckpt.load.destinations import Destinations, Target, match
from localckpt.save import staging
from localckpt.save.staging import StagingArena, plan_layout
from localckpt.storage import device_reader, shard_reader, tensor_reads
from localckpt.storage.manifest import ShardManifest, TensorEntry, dtype_name
from localckpt.storage.shard_reader import read_chunks_into
from localckpt.storage.space import chunking
from localckpt.storage.store import ShardStore
from localckpt.storage.views import byte_view, device_bytes


class _Log(list[str]):
    pass


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _Log:
    """device_reader's torch with CUDA streams and events that log, and no pinning."""
    log = _Log()

    class Event:
        def record(self, stream: Any = None) -> None:
            log.append("record")

        def synchronize(self) -> None:
            log.append("event sync")

    class Stream:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def wait_stream(self, other: Any) -> None:
            log.append("wait")

        def synchronize(self) -> None:
            log.append("stream sync")

    class On:
        def __init__(self, stream: Any) -> None:
            pass

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> None:
            return None

    class Torch:
        cuda = types.SimpleNamespace(Stream=Stream, Event=Event, stream=On,
                                     current_stream=lambda device=None: Stream())

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def empty(*args: Any, pin_memory: bool = False, device: Any = None,
                  **kwargs: Any) -> torch.Tensor:
            return torch.empty(*args, **kwargs)

    monkeypatch.setattr(device_reader, "torch", Torch())
    return log


def _shard(tmp_path: Path, seed: int, chunk_nbytes: int, threads: int, back_to_back: bool = False
           ) -> tuple[ShardStore, Any, list[torch.Tensor], list[str]]:
    """``back_to_back``: every tensor a multiple of 64 bytes, so no padding between any two
    (the sources of a chunk are then cut with no gap pieces)."""
    rng = random.Random(seed)
    tensors, devices = [], []
    for _ in range(rng.randint(1, 60)):
        kind = rng.random()
        if back_to_back:
            t = torch.randn(16 * rng.randint(1, 20) if kind < 0.8 else
                            16 * rng.randint(1, 3 * chunk_nbytes // 64))
            tensors.append(t)
            devices.append("cuda:0")
            continue
        t = (torch.randn(()) if kind < 0.1 else torch.empty(0) if kind < 0.15
             else torch.randn(rng.randint(1, 300)) if kind < 0.7
             else torch.randn(rng.randint(1, 3 * chunk_nbytes // 4)))  # spans chunks
        if rng.random() < 0.2:
            t = (t * 100).to(torch.int8)
        tensors.append(t)
        devices.append("cuda:0" if rng.random() < 0.7 else "cpu")
    layout = plan_layout(tensors)
    nbytes, count = chunking(layout.nbytes, chunk_nbytes)
    payload = StagingArena(pin=False).stage(tensors, layout, nbytes * count)
    entries = tuple(TensorEntry(f"t{i}", dtype_name(t.dtype), tuple(t.shape), layout.offsets[i],
                                layout.sizes[i], devices[i]) for i, t in enumerate(tensors))
    store = ShardStore(tmp_path / f"root{seed}", "s", writer_rank=0, chunk_nbytes=chunk_nbytes,
                       io_threads=threads)
    manifest = ShardManifest("s", 1, 0, 1, entries, {"dict": []}, "plain", layout.nbytes,
                             nbytes, count, ())
    ref, _ = store.write(manifest, payload)
    return store, ref, tensors, devices


@pytest.mark.parametrize("back_to_back", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_every_byte_lands_where_it_belongs(tmp_path: Path, fake_cuda: _Log, seed: int,
                                           back_to_back: bool) -> None:
    """Random shards (tensors within a chunk, across chunks, empty, 0-dim; host and "device"
    ones mixed; or all on the device with no padding between them) through both copy paths,
    on 1 to 4 readers sharing few slots."""
    rng = random.Random(seed)
    store, ref, tensors, devices = _shard(tmp_path, seed, rng.choice([256, 1024, 4096]),
                                          rng.choice([1, 2, 4]), back_to_back)
    try:
        m = store.read_manifest(ref)
        out = [torch.full_like(t, 7) for t in tensors]
        host, small = [], []  # host tensors read directly, or copied out of the window
        for e, t in zip(m.tensors, out, strict=True):
            if e.nbytes and e.device == "cpu":
                if rng.random() < 0.5:
                    small.append((e.offset, t.data_ptr(), e.nbytes))
                else:
                    host.append((e.offset, byte_view(t)))
        dev = [(e.offset, device_bytes(t)) for e, t in zip(m.tensors, out, strict=True)
               if e.nbytes and e.device != "cpu"]
        scatter = device_reader.DeviceScatter(torch.device("cpu"), dev, m.chunk_nbytes,
                                              rng.choice([1, 3])) if dev else None
        read_chunks_into(ref.path / "data" / "c", m, host, store._pool, device=scatter,
                         small=small)
    finally:
        store.close()
    for i, (saved, loaded) in enumerate(zip(tensors, out, strict=True)):
        assert torch.equal(saved, loaded), (i, devices[i])


def test_a_copy_that_fails_midway_is_waited_for_before_the_error_returns(
        fake_cuda: _Log, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first piece's copy is queued, the second one's fails: the slot's event is recorded
    anyway (take() waits for it) and finish() synchronizes the slot's stream."""
    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    scatter = device_reader.DeviceScatter(torch.device("cpu"), [(0, a), (64, b)], 128, 2)
    real = torch.Tensor.copy_
    calls = []

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        calls.append(1)
        fake_cuda.append(f"copy {len(calls)}")
        if len(calls) == 2:
            raise RuntimeError("CUDA error: launch failure (injected)")
        return real(self, src, non_blocking=non_blocking)

    slot = scatter.take()
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with pytest.raises(RuntimeError, match="injected"):
        scatter.copy_out(slot, 0)
    monkeypatch.setattr(torch.Tensor, "copy_", real)
    scatter.give(slot)
    scatter.finish()
    assert fake_cuda[fake_cuda.index("copy 2"):] == ["copy 2", "record", "stream sync"]


def test_finish_waits_for_every_slot_even_when_one_fails(fake_cuda: _Log) -> None:
    scatter = device_reader.DeviceScatter(torch.device("cpu"), [], 64, 3)
    slots = [scatter.take() for _ in range(3)]
    waited = []

    def broken() -> None:
        waited.append("broken")
        raise RuntimeError("CUDA error (injected)")

    slots[0].stream.synchronize = broken  # type: ignore[method-assign]
    for i, slot in enumerate(slots[1:], 1):
        slot.stream.synchronize = lambda i=i: waited.append(i)  # type: ignore[method-assign]
    for slot in slots:
        scatter.give(slot)
    with pytest.raises(RuntimeError, match="injected"):
        scatter.finish()
    assert waited == ["broken", 1, 2]


class _OnDevice(torch.Tensor):
    """A host tensor that says it is on cuda:0 (what ``match`` looks at)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda:0")

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]
        return False


def _on_device(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_OnDevice, t)


def _manifest(n: int, nbytes: int = 32) -> ShardManifest:
    entries = tuple(TensorEntry(f"t{i}", "float32", (nbytes // 4,), i * nbytes, nbytes, "cuda:0")
                    for i in range(n))
    return ShardManifest("s", 1, 0, 1, entries, {"dict": []}, "plain", n * nbytes, 4096, 1,
                         (0,))


def test_tied_device_tensors_are_filled_by_a_copy_not_left_out() -> None:
    """Two key paths sharing memory on the device (tied embedding and head): both filled by a
    copy, as before the pinned path; two on the host are left out; the rest read into."""
    gpu = torch.zeros(16)
    cpu = torch.zeros(16)
    targets = {"t0": Target(_on_device(gpu[:8])), "t1": Target(_on_device(gpu[:8])),
               "t2": Target(_on_device(torch.zeros(8))),
               "t3": Target(cpu[:8]), "t4": Target(cpu[4:12])}
    got = match(_manifest(5), targets, torch.device("cuda:0"))
    assert [t is not None for t in got.direct] == [False, False, True, False, False]
    assert sorted(got.copied) == [0, 1]


def test_device_tensors_overlapping_in_part_are_left_out_not_copied_over_each_other() -> None:
    """A device tensor and a view of part of it: copying both, the last would win (the other
    key returned holding wrong bytes); they come back fresh, as on the host."""
    w = torch.zeros(8)
    targets = {"t0": Target(_on_device(w)), "t1": Target(_on_device(w[2:4])),
               "t2": Target(_on_device(torch.zeros(8)))}
    entries = (TensorEntry("t0", "float32", (8,), 0, 32, "cuda:0"),
               TensorEntry("t1", "float32", (2,), 64, 8, "cuda:0"),
               TensorEntry("t2", "float32", (8,), 128, 32, "cuda:0"))
    m = ShardManifest("s", 1, 0, 1, entries, {"dict": []}, "plain", 160, 4096, 1, (0,))
    got = match(m, targets, torch.device("cuda:0"))
    assert sorted(got.copied) == [] and [t is not None for t in got.direct] == [False, False,
                                                                                True]


def test_a_checksum_failure_is_not_blamed_on_device_destinations() -> None:
    """Checksums are taken on the host: a failed read into ``into``'s device tensors means the
    copy is bad, so no second read into private memory is tried (``ctx`` is never used)."""
    rnd = types.SimpleNamespace(destinations=Destinations([_on_device(torch.zeros(8)), None]))
    restore._blame_destination(None, rnd, (1, 0), CorruptShardError("bad"))  # type: ignore[arg-type]


@pytest.mark.parametrize("in_a_run", [True, False])
def test_staging_that_fails_after_device_copies_were_queued_waits_for_them(
        monkeypatch: pytest.MonkeyPatch, in_a_run: bool) -> None:
    synced = []
    arena = StagingArena(pin=False)
    arena._streams = {torch.device("cuda:0"): types.SimpleNamespace(  # type: ignore[dict-item]
        synchronize=lambda: synced.append("cuda:0"))}
    monkeypatch.setattr(arena, "_stage_cuda", lambda *args: synced.append("queued") or object())

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("staging a CPU tensor failed (injected)")

    monkeypatch.setattr(staging, "_stage_cpu", broken)
    tensors = [_on_device(torch.zeros(4)), torch.zeros(4)]
    if not in_a_run:  # the host tensor staged alone, not concatenated in a run
        monkeypatch.setattr(staging, "GATHER_MAX_NBYTES", 0)
    layout = plan_layout(tensors)
    assert bool(layout.runs) == in_a_run
    with pytest.raises(RuntimeError, match="injected"):
        arena.stage_begin(tensors, layout, layout.nbytes)
    assert synced == ["queued", "cuda:0"]


# ---------------------------------------------------------------- allocating while reading


class _Recorder:
    """read_shard_tensors with fresh tensors made here (device entries as _OnDevice host
    tensors), every allocation and every chunk queued logged, and at each chunk queued a
    check that every tensor with bytes in it exists."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, m: ShardManifest,
                 given: list[torch.Tensor | None], fail_at: int | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.made = {k for k, t in enumerate(given) if t is not None}
        self.running = 0
        index = {id(e): k for k, e in enumerate(m.tensors)}
        size = m.chunk_nbytes

        def fresh(e: TensorEntry, device: Any, cache: Any) -> torch.Tensor:
            k = index[id(e)]
            if fail_at is not None and len(self.events) >= fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            self.events.append(("alloc", k))
            self.made.add(k)
            t = torch.empty(e.shape, dtype=getattr(torch, e.dtype))
            return _on_device(t) if e.device != "cpu" and e.nbytes else t

        real_submit, real_read = tensor_reads.ChunkReads.submit, tensor_reads.ChunkReads._read

        def submit(reads: Any, c: int, into: Any) -> None:
            self.events.append(("read", c))
            missing = [k for k, e in enumerate(m.tensors) if e.nbytes and k not in self.made
                       and e.offset // size <= c <= (e.offset + e.nbytes - 1) // size]
            assert not missing, f"chunk {c} queued before tensors {missing} existed"
            real_submit(reads, c, into)

        def read(reads: Any, *args: Any) -> None:
            self.running += 1
            try:
                real_read(reads, *args)
            finally:
                self.running -= 1

        monkeypatch.setattr(tensor_reads, "fresh", fresh)
        monkeypatch.setattr(tensor_reads.ChunkReads, "submit", submit)
        monkeypatch.setattr(tensor_reads.ChunkReads, "_read", read)


@pytest.mark.parametrize("seed", range(30))
def test_tensors_allocated_while_reading_get_every_byte(tmp_path: Path, fake_cuda: _Log,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        seed: int) -> None:
    """Random shards, some entries given (on the host or the "device"), the rest made while
    the chunks already covered are read: every chunk is queued only once each tensor with bytes
    in it exists, and every tensor comes back with its saved bytes."""
    rng = random.Random(seed)
    store, ref, tensors, devices = _shard(tmp_path, seed, rng.choice([256, 1024, 4096]),
                                          rng.choice([1, 2, 4]))
    try:
        m = store.read_manifest(ref)
        given: list[torch.Tensor | None] = [
            None if rng.random() < 0.6 or not e.nbytes else
            _on_device(torch.full_like(t, 7)) if e.device != "cpu" else torch.full_like(t, 7)
            for e, t in zip(m.tensors, tensors, strict=True)]
        log = _Recorder(monkeypatch, m, given)
        out = tensor_reads.read_shard_tensors(ref.path / "data" / "c", m, given,
                                              torch.device("cuda:0"), store._pool,
                                              rng.choice([1, 3]))
    finally:
        store.close()
    assert sorted(c for what, c in log.events if what == "read") == list(range(m.chunk_count))
    for i, (saved, loaded) in enumerate(zip(tensors, out, strict=True)):
        assert torch.equal(saved, loaded), (i, devices[i])
        if given[i] is not None:
            assert loaded is given[i]


def _big_and_small(tmp_path: Path) -> tuple[ShardStore, Any, list[torch.Tensor]]:
    """Many small tensors packed first, then two that span chunks (as a CUDA save lays out)."""
    tensors = [torch.randn(16) for _ in range(40)] + [torch.randn(700), torch.randn(900)]
    layout = plan_layout(tensors)
    nbytes, count = chunking(layout.nbytes, 1024)
    payload = StagingArena(pin=False).stage(tensors, layout, nbytes * count)
    entries = tuple(TensorEntry(f"t{i}", "float32", tuple(t.shape), layout.offsets[i],
                                layout.sizes[i], "cuda:0") for i, t in enumerate(tensors))
    store = ShardStore(tmp_path / "root", "s", writer_rank=0, chunk_nbytes=1024, io_threads=2)
    manifest = ShardManifest("s", 1, 0, 1, entries, {"dict": []}, "plain", layout.nbytes,
                             nbytes, count, ())
    ref, _ = store.write(manifest, payload)
    return store, ref, tensors


def test_the_big_tensors_are_made_first_and_read_while_the_small_ones_are_made(
        tmp_path: Path, fake_cuda: _Log, monkeypatch: pytest.MonkeyPatch) -> None:
    store, ref, tensors = _big_and_small(tmp_path)
    try:
        m = store.read_manifest(ref)
        log = _Recorder(monkeypatch, m, [None] * len(tensors))
        out = tensor_reads.read_shard_tensors(ref.path / "data" / "c", m, None,
                                              torch.device("cuda:0"), store._pool, 3)
    finally:
        store.close()
    allocs = [k for what, k in log.events if what == "alloc"]
    assert allocs[:2] == [40, 41] and allocs[2:] == list(range(40))
    first_small = log.events.index(("alloc", 0))
    # the chunks holding only big tensors' bytes are queued before any small tensor is made
    big_only = {c for c in range(m.chunk_count) if c * 1024 >= m.tensors[40].offset}
    assert {c for what, c in log.events[:first_small] if what == "read"} == big_only
    assert all(torch.equal(a, b) for a, b in zip(tensors, out, strict=True))


def test_a_corrupt_chunk_stops_the_allocation_and_no_read_outlives_the_error(
        tmp_path: Path, fake_cuda: _Log, monkeypatch: pytest.MonkeyPatch) -> None:
    store, ref, tensors = _big_and_small(tmp_path)
    m = store.read_manifest(ref)
    last = ref.path / "data" / "c" / str(m.chunk_count - 1)  # a big tensor's: read first
    data = bytearray(last.read_bytes())
    data[10] ^= 0xFF
    last.write_bytes(bytes(data))
    try:
        log = _Recorder(monkeypatch, m, [None] * len(tensors))
        with pytest.raises(CorruptShardError, match=f"{last}: checksum mismatch"):
            tensor_reads.read_shard_tensors(ref.path / "data" / "c", m, None,
                                            torch.device("cuda:0"), store._pool, 3)
        assert log.running == 0
    finally:
        store.close()
    assert "stream sync" in fake_cuda  # the slots' copies waited for


def test_an_allocation_that_fails_waits_for_the_reads_already_queued(
        tmp_path: Path, fake_cuda: _Log, monkeypatch: pytest.MonkeyPatch) -> None:
    store, ref, tensors = _big_and_small(tmp_path)
    try:
        m = store.read_manifest(ref)
        log = _Recorder(monkeypatch, m, [None] * len(tensors), fail_at=12)
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            tensor_reads.read_shard_tensors(ref.path / "data" / "c", m, None,
                                            torch.device("cuda:0"), store._pool, 3)
        assert log.running == 0 and ("read", m.chunk_count - 1) in log.events
    finally:
        store.close()
    assert "stream sync" in fake_cuda


def test_a_slot_whose_wait_fails_goes_back_and_the_load_raises_instead_of_hanging(
        tmp_path: Path, fake_cuda: _Log, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA error is sticky: every wait for a slot's last copy fails from then on. Each
    reader that takes a slot raises, and gives the slot back: the others do not wait for ever
    for one."""
    class Broken:
        def record(self, stream: Any = None) -> None:
            pass

        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access (injected)")

    monkeypatch.setattr(device_reader.torch.cuda, "Event", Broken)
    store, ref, _ = _big_and_small(tmp_path)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            tensor_reads.read_shard_tensors(ref.path / "data" / "c", store.read_manifest(ref),
                                            None, torch.device("cuda:0"), store._pool, 1)
        except BaseException as exc:
            outcome.append(exc)

    try:
        monkeypatch.setattr(tensor_reads, "fresh", lambda e, device, cache: _on_device(
            torch.empty(e.shape, dtype=getattr(torch, e.dtype))))
        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        worker.join(timeout=20)
        assert not worker.is_alive(), "the load hangs waiting for a slot that was lost"
    finally:
        if not worker.is_alive():
            store.close()
    assert len(outcome) == 1 and "injected" in str(outcome[0])


def test_an_interrupt_while_waiting_leaves_no_read_running(
        tmp_path: Path, fake_cuda: _Log, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the wait for the reads: the reads not started are dropped and the running
    ones waited for before KeyboardInterrupt goes on; none starts or copies after it."""
    store, ref, tensors = _big_and_small(tmp_path)
    m = store.read_manifest(ref)
    log = _Recorder(monkeypatch, m, [None] * len(tensors))
    started: list[int] = []
    real_read = tensor_reads.ChunkReads._read

    def slow(reads: Any, i: int, *args: Any) -> None:
        started.append(i)
        time.sleep(0.05)
        real_read(reads, i, *args)

    monkeypatch.setattr(tensor_reads.ChunkReads, "_read", slow)
    real_wait = shard_reader.wait
    calls: list[int] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(shard_reader, "wait", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            tensor_reads.read_shard_tensors(ref.path / "data" / "c", m, None,
                                            torch.device("cuda:0"), store._pool, 3)
        running, begun, copies = log.running, len(started), fake_cuda.count("record")
        time.sleep(0.3)
        assert (running, len(started), fake_cuda.count("record")) == (0, begun, copies)
        assert begun < m.chunk_count  # those not started were dropped
    finally:
        store.close()


def test_a_given_tensor_that_cannot_be_read_into_is_refused_before_any_read(
        tmp_path: Path, fake_cuda: _Log) -> None:
    store, ref, tensors = _big_and_small(tmp_path)
    try:
        m = store.read_manifest(ref)
        given: list[torch.Tensor | None] = [None] * len(tensors)
        given[40] = torch.full_like(tensors[40], 7)  # fine: a host tensor, read first
        given[0] = _on_device(torch.full((32,), 7.0)[::2])  # not contiguous
        with pytest.raises(ValueError, match="'t0' is to be read into a tensor on cuda:0"):
            tensor_reads.read_shard_tensors(ref.path / "data" / "c", m, given,
                                            torch.device("cuda:0"), store._pool, 3)
        assert given[40] is not None and bool((given[40] == 7).all())
        with pytest.raises(ValueError, match="41 tensors given for a shard of 42 entries"):
            tensor_reads.read_shard_tensors(ref.path / "data" / "c", m, given[1:],
                                            torch.device("cuda:0"), store._pool, 3)
        with pytest.raises(ValueError, match="43 tensors given for a shard of 42 entries"):
            tensor_reads.read_shard_tensors(ref.path / "data" / "c", m, [*given, None], None,
                                            store._pool, 3)
        assert bool((given[40] == 7).all())
    finally:
        store.close()


def test_each_chunk_is_copied_after_what_the_stream_queued_once_its_tensors_existed(
        tmp_path: Path, fake_cuda: _Log, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors are made after the first slots: each chunk's copies wait again for the
    loading thread's stream (another thread may have queued work on memory the allocator
    hands out later)."""
    store, ref, tensors = _big_and_small(tmp_path)
    try:
        m = store.read_manifest(ref)
        _Recorder(monkeypatch, m, [None] * len(tensors))
        tensor_reads.read_shard_tensors(ref.path / "data" / "c", m, None,
                                        torch.device("cuda:0"), store._pool, 1)
    finally:
        store.close()
    copies = fake_cuda.count("record")  # one per chunk copied out
    assert copies == m.chunk_count and fake_cuda.count("wait") >= copies
    for k, entry in enumerate(fake_cuda):
        if entry == "record":
            assert "wait" in fake_cuda[:k]
