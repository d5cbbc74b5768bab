"""Staging arena pack / unpack (no processes)."""

from __future__ import annotations

import gc
import itertools
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_python

from localckpt import LocalCheckpointManager
from localckpt.errors import CorruptShardError
from localckpt.save.early_copies import EagerCopies
from localckpt.save.staging import StagingArena, plan_layout, unpack


def test_unpack_inverts_stage_into_separate_storages() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.tensor(7, dtype=torch.int64),
               torch.randn(0), torch.randn(200_000, generator=g).to(torch.bfloat16),
               torch.randn(4, 4, generator=g).t()]
    layout = plan_layout(tensors)
    buf = StagingArena(pin=False).stage(tensors, layout, layout.nbytes + 100)
    back = unpack(buf, [(o, n, t.dtype, t.shape) for t, o, n in
                        zip(tensors, layout.offsets, layout.sizes, strict=True)])
    for t, b in zip(tensors, back, strict=True):
        assert torch.equal(t, b) and b.dtype == t.dtype and b.is_contiguous()
    assert len({b.untyped_storage().data_ptr() for b in back if b.numel()}) == 4


@pytest.mark.parametrize("entry", [(0, 8, torch.float32, (3,)), (96, 8, torch.float32, (2,)),
                                   (-4, 4, torch.float32, (1,))])
def test_unpack_refuses_entries_outside_the_data(entry: tuple) -> None:
    with pytest.raises(CorruptShardError, match="does not fit its 100-byte data"):
        unpack(torch.zeros(100, dtype=torch.uint8), [entry])


def test_layout_packs_gathered_tensors_back_to_back_in_capped_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs' packing (CUDA tensors on a GPU machine) checked here with CPU tensors."""
    from localckpt.save import staging

    monkeypatch.setattr(staging, "GATHER_MAX_NBYTES", 1024)
    monkeypatch.setattr(staging, "GATHER_RUN_MAX_NBYTES", 2048)
    tensors = [torch.arange(3, dtype=torch.float32), torch.zeros(5000),  # 20,000 B: not gathered
               torch.arange(7, dtype=torch.int16), torch.arange(250, dtype=torch.float32),
               torch.arange(250, dtype=torch.float32) + 1000, torch.ones(1, dtype=torch.int16),
               torch.arange(256, dtype=torch.float32) + 2000]
    layout = plan_layout(tensors)
    # float32 [0, 3, 4] fit 2,048 bytes; [6] starts the next run; int16 [2, 5] run apart
    assert layout.runs == ((0, 3, 4), (6,), (2, 5))
    for run in layout.runs:
        assert layout.offsets[run[0]] % 64 == 0
        for a, b in itertools.pairwise(run):
            assert layout.offsets[b] == layout.offsets[a] + layout.sizes[a]
    assert layout.offsets[1] % 64 == 0
    spans = sorted((o, o + n) for o, n in zip(layout.offsets, layout.sizes, strict=True))
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert layout.nbytes == max(end for _, end in spans)
    buf = StagingArena(pin=False).stage(tensors, layout, layout.nbytes)
    back = unpack(buf, [(o, n, t.dtype, t.shape) for t, o, n in
                        zip(tensors, layout.offsets, layout.sizes, strict=True)])
    assert all(torch.equal(t, b) for t, b in zip(tensors, back, strict=True))


def _staged_back(arena: StagingArena, tensors: list[torch.Tensor], early: EagerCopies,
                 total_extra: int = 0) -> list[torch.Tensor]:
    """Offer ``tensors`` to ``early`` in order (as a walk does), then lay out and stage the rest
    as a save does; the tensors unpacked from the arena."""
    for i, t in enumerate(tensors):
        early.offer(i, t)
    layout = plan_layout(tensors, early.placed, early.end)
    assert layout.copied == frozenset(early.placed)
    buf = arena.stage(tensors, layout, layout.nbytes + total_extra)
    spans = sorted((o, o + n) for o, n in zip(layout.offsets, layout.sizes, strict=True) if n)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    return unpack(buf, [(o, n, t.dtype, t.shape) for t, o, n in
                        zip(tensors, layout.offsets, layout.sizes, strict=True)])


def _mixed(seed: int, big: int = 300_000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(big, generator=g), torch.randn(7, generator=g),
            torch.randn(600, 700, generator=g).t(),  # large and not contiguous
            torch.arange(5, dtype=torch.int16), torch.randn(big // 2, generator=g).double(),
            torch.randn(3, generator=g)]


def test_large_tensors_are_copied_as_the_walk_meets_them_from_the_second_save_on() -> None:
    arena = StagingArena(pin=False)
    first = EagerCopies(arena)  # no buffer yet: nothing copied early
    tensors = _mixed(0)
    back = _staged_back(arena, tensors, first)
    assert first.placed == {} and all(map(torch.equal, tensors, back))
    early = EagerCopies(arena)
    tensors = _mixed(1)  # other values, same sizes
    back = _staged_back(arena, tensors, early)
    assert sorted(early.placed) == [0, 2, 4]  # the large ones, in the order met, from 0
    assert early.placed[0] == 0 and all(o % 64 == 0 for o in early.placed.values())
    assert all(map(torch.equal, tensors, back))


def test_tensors_that_no_longer_fit_go_where_the_layout_puts_them() -> None:
    arena = StagingArena(pin=False)
    _staged_back(arena, _mixed(0), EagerCopies(arena))
    early = EagerCopies(arena)
    tensors = _mixed(2)
    tensors[0] = torch.randn(arena.capacity // 4 + 1)  # grew: no longer fits, nor do later ones
    back = _staged_back(arena, tensors, early)
    assert early.placed == {} and all(map(torch.equal, tensors, back))
    tensors = _mixed(3)
    tensors[4] = torch.randn(arena.capacity // 8, dtype=torch.float64)  # the third one grew
    early = EagerCopies(arena)
    back = _staged_back(arena, tensors, early)
    assert sorted(early.placed) == [0, 2] and all(map(torch.equal, tensors, back))


def test_a_stage_that_needs_a_larger_buffer_copies_the_early_ones_again() -> None:
    """The early copies went to the buffer a larger stage replaces: made again into the new."""
    arena = StagingArena(pin=False)
    _staged_back(arena, _mixed(0), EagerCopies(arena))
    before = arena.allocations
    early = EagerCopies(arena)
    tensors = _mixed(4)
    back = _staged_back(arena, tensors, early, total_extra=arena.capacity)
    assert early.placed and arena.allocations == before + 1
    assert all(map(torch.equal, tensors, back))


def test_lazy_views_zero_tensors_and_small_ones_are_left_to_the_layout() -> None:
    arena = StagingArena(pin=False)
    arena.reserve(1 << 24)
    early = EagerCopies(arena)
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(300_000, dtype=torch.complex64, generator=g).conj(),
               torch._efficientzerotensor(300_000), torch.randn(1000, generator=g),
               torch.randn(300_000, generator=g)._neg_view(),
               torch.randn(300_000, generator=g)]
    back = _staged_back(arena, tensors, early)
    assert list(early.placed) == [4]
    assert all(map(torch.equal, tensors, back))


def test_a_save_that_fails_after_early_copies_waits_for_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A leaf the walk refuses after a large tensor was queued: nothing may still write into the
    arena when the error returns (the next save stages into it)."""
    from localckpt.save import prepare

    synced: list[str] = []
    arena = StagingArena(pin=False)
    arena.reserve(1 << 24)
    monkeypatch.setattr(arena, "synchronize", lambda: synced.append("synchronized"))
    real = EagerCopies.offer

    def offer(self: EagerCopies, i: int, t: torch.Tensor) -> None:
        real(self, i, t)
        self._streams.add(torch.device("cuda:0"))  # as if it had queued a device copy

    monkeypatch.setattr(EagerCopies, "offer", offer)
    ctx = types.SimpleNamespace(rank=0)
    with pytest.raises(TypeError, match="unsupported value"):
        prepare.stage_shard(ctx, arena, {"w": torch.randn(300_000), "x": object()},  # type: ignore[arg-type]
                            1, None, None, True)
    assert synced == ["synchronized"]


class _OnSave:
    """A Stateful whose state_dict() first runs ``effect``: user code the walk of a save runs
    after it met the tensors before it."""

    def __init__(self, effect: Any) -> None:
        self.effect = effect

    def state_dict(self) -> dict[str, int]:
        self.effect()
        return {"n": 1}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        pass


def test_a_stateful_that_updates_tensors_met_before_it_is_saved_as_it_left_them(
        tmp_path: Path) -> None:
    """A Stateful's state_dict() may apply pending updates to tensors the walk met before it
    (a lazy EMA flushed on save): the save holds every tensor as it is after that, the large
    ones copied early included, never a mix of before and after."""
    big, small = torch.zeros(1 << 19), torch.zeros(16)  # 2 MiB: copied early
    pending = [0.0]

    def flush() -> None:
        big.add_(pending[0])
        small.add_(pending[0])
        pending[0] = 0.0

    lazy = _OnSave(flush)
    with LocalCheckpointManager(tmp_path / "ckpt", "s") as mgr:
        for it in (1, 2, 3):
            pending[0] = float(it)
            mgr.save({"big": big, "small": small, "ema": lazy, "after": torch.ones(1 << 19)},
                     it)
            back, _ = mgr.load()
            assert torch.equal(back["big"], big) and torch.equal(back["small"], small), it


def test_a_growing_arena_never_holds_the_old_buffer_and_the_new_one_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned on a GPU machine: both at once would double the host memory of a large shard."""
    alive: list[bool] = []
    grow = StagingArena.buffer

    def buffer(self: StagingArena, nbytes: int, slack: int = 0) -> torch.Tensor:
        if self._buffer is not None and self._buffer.numel() < nbytes:
            old = weakref.ref(self._buffer.untyped_storage())
            self._buffer = None
            gc.collect()
            alive.append(old() is not None)
        return grow(self, nbytes, slack)

    monkeypatch.setattr(StagingArena, "buffer", buffer)
    with LocalCheckpointManager(tmp_path / "ckpt", "s") as mgr:
        mgr.save({"w": torch.randn(1 << 19)}, 1)
        mgr.save({"w": torch.randn(1 << 19), "v": torch.randn(1 << 15)}, 2)  # grows: 128 KiB
    assert alive == [False]


def test_the_first_saves_after_reserve_fit_the_reserved_arena(tmp_path: Path) -> None:
    """reserve() sizes the arena once; the saves after it (whose large tensors come first,
    with other padding) fit it, so none allocates again and copies everything twice."""
    sd = {"w1": torch.randn(262145), "step": torch.zeros(15), "w2": torch.randn(262145)}
    # 1 MiB + 4 B, 60 B, 1 MiB + 4 B: the padding differs with the order
    with LocalCheckpointManager(tmp_path / "ckpt", "s") as mgr:
        mgr.reserve(sd)
        arena = mgr._save._arena
        assert arena.allocations == 1
        for it in (1, 2, 3):
            mgr.save(sd, it)
        assert arena.allocations == 1
        back, _ = mgr.load()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_a_stateful_that_grows_a_tensor_met_before_it_never_corrupts_the_shard(
        tmp_path: Path) -> None:
    """A Stateful's state_dict() resizes a tensor already copied early: that tensor no longer
    fits its early slot, so the layout places it anew instead of letting it overlap the next."""
    big, after = torch.zeros(1 << 19), torch.full((1 << 19,), 7.0)  # 2 MiB each
    grow = [False]

    def maybe_grow() -> None:
        if grow[0]:
            big.resize_(1 << 20)
            big.fill_(1.0)

    grows = _OnSave(maybe_grow)
    with LocalCheckpointManager(tmp_path / "ckpt", "s") as mgr:
        for it in (1, 2, 3):
            grow[0] = it == 2
            mgr.save({"big": big, "s": grows, "after": after}, it)
            back, _ = mgr.load()
            assert torch.equal(back["big"], big) and torch.equal(back["after"], after), it


def test_a_module_and_an_optimizer_met_as_statefuls_keep_the_early_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's modules, optimizers and schedulers change no tensor in state_dict(): the large
    tensors met before them are not copied a second time (each would cross twice)."""
    model = torch.nn.Linear(1024, 1024)  # a 4 MiB weight
    opt = torch.optim.Adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    copied: list[frozenset[int]] = []
    stage = StagingArena.stage_begin

    def spy(self: StagingArena, tensors: Any, layout: Any, total: int) -> Any:
        copied.append(layout.copied)
        return stage(self, tensors, layout, total)

    monkeypatch.setattr(StagingArena, "stage_begin", spy)
    with LocalCheckpointManager(tmp_path / "ckpt", "s") as mgr:
        for it in (1, 2):
            mgr.save({"model": model, "optim": opt, "sched": sched}, it)
        back, _ = mgr.load()
    assert copied[0] == frozenset() and len(copied[1]) == 3  # weight, exp_avg, exp_avg_sq
    assert torch.equal(back["model"]["weight"], model.weight.detach())


def test_an_in_place_change_by_a_stateful_is_copied_again(tmp_path: Path) -> None:
    """A user's Stateful is not trusted to leave other tensors alone, and an in-place change
    (a new version of the tensor) is seen even from torch's own (here a module's hook)."""
    model = torch.nn.Linear(1024, 1024)
    big = torch.zeros(1 << 19)

    def bump(module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        big.add_(1)  # a state dict hook of the module changes a tensor met before it

    model._register_state_dict_hook(bump)
    with LocalCheckpointManager(tmp_path / "ckpt", "s") as mgr:
        for it in (1, 2, 3):
            mgr.save({"big": big, "model": model}, it)
            back, _ = mgr.load()
            assert torch.equal(back["big"], big), it


def test_inference_tensors_are_saved_though_they_keep_no_version(tmp_path: Path) -> None:
    with torch.inference_mode():
        big = torch.randn(1 << 19)  # 2 MiB: large enough to be copied early
    with LocalCheckpointManager(tmp_path / "ckpt", "s") as mgr:
        for it in (1, 2):
            mgr.save({"big": big, "after": torch.randn(1 << 19)}, it)
        back, _ = mgr.load()
    assert torch.equal(back["big"], big)


def test_small_host_tensors_are_staged_in_runs_by_value() -> None:
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, dtype=torch.complex64, generator=g)
    tensors = [torch.nn.Parameter(torch.randn(3, 4, generator=g)),  # requires grad
               torch.randn(4, 4, generator=g).t(),  # not contiguous
               torch.tensor(5.0), z.conj(), z.conj().imag,  # 0-d; conjugate and negative views
               torch._efficientzerotensor(7), torch.randn(10, generator=g).to(torch.bfloat16),
               torch.randn(9, generator=g), torch.zeros(0)]
    layout = plan_layout(tensors)
    in_runs = sorted(i for run in layout.runs for i in run)
    assert in_runs == [0, 1, 2, 3, 4, 5, 6, 7]  # all but the empty one
    assert layout.runs[0] == (0, 1, 2, 4, 5, 7)  # float32, in order, back to back
    buf = StagingArena(pin=False).stage(tensors, layout, layout.nbytes)
    back = unpack(buf, [(o, n, t.dtype, t.shape) for t, o, n in
                        zip(tensors, layout.offsets, layout.sizes, strict=True)])
    for t, b in zip(tensors, back, strict=True):
        assert torch.equal(t.detach().resolve_conj().resolve_neg(), b)


def test_a_tensor_subclass_is_never_concatenated_with_others() -> None:
    seen: list[str] = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    tensors = [torch.ones(4), torch.arange(4.0).as_subclass(Logged), torch.full((4,), 2.0)]
    layout = plan_layout(tensors)
    assert layout.runs == ((0, 2),)
    seen.clear()
    buf = StagingArena(pin=False).stage(tensors, layout, layout.nbytes)
    assert "cat" not in seen
    back = unpack(buf, [(o, n, t.dtype, t.shape) for t, o, n in
                        zip(tensors, layout.offsets, layout.sizes, strict=True)])
    assert [b.tolist() for b in back] == [[1.0] * 4, [0.0, 1.0, 2.0, 3.0], [2.0] * 4]


def test_a_save_inside_inference_mode_leaves_later_saves_working(tmp_path: Path) -> None:
    state = {"w": torch.randn(1 << 19), "b": torch.randn(3)}  # one copied early, one in a run
    with LocalCheckpointManager(tmp_path / "ckpt", "s") as mgr:
        with torch.inference_mode():  # an evaluation loop's save: the arena is made here
            mgr.save(state, 1)
        mgr.save(state, 2)
        back, _ = mgr.load()
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


@pytest.mark.parametrize("case", ["freed", "freed view", "shrunk", "freed by a Stateful"])
def test_a_tensor_reaching_past_its_storage_is_refused_not_read(tmp_path: Path,
                                                                  case: str) -> None:
    """FSDP frees an unsharded parameter's storage with resize_(0): its data pointer is null,
    and a copy from it crashed the process. A view of a freed storage has a data pointer (its
    offset), a shrunk storage a short one: staging them read freed memory (a crash, or heap
    bytes written to the checkpoint); so did a tensor a Stateful freed after the walk met
    it."""
    setup = {
        "freed": "p = torch.randn(4, 4); p.untyped_storage().resize_(0)\n"
                 "state = {'layer': {'w': p}, 'b': torch.randn(3)}\n",
        "freed view": "b = torch.arange(16.0); t = b[4:8]; b.untyped_storage().resize_(0)\n"
                      "state = {'layer': {'w': t}}\n",
        "shrunk": "t = torch.arange(4096.0); t.untyped_storage().resize_(8)\n"
                  "state = {'layer': {'w': t}}\n",
        "freed by a Stateful": (
            "t = torch.arange(4096.0)\n"
            "class Frees:\n"
            "    def state_dict(self):\n"
            "        t.untyped_storage().resize_(0)\n"
            "        return {}\n"
            "    def load_state_dict(self, sd):\n"
            "        pass\n"
            "state = {'layer': {'w': t}, 'z': Frees()}\n"),
    }[case]
    code = ("import torch\nfrom localckpt import LocalCheckpointManager\n" + setup +
            f"with LocalCheckpointManager({str(tmp_path / 'ckpt')!r}, 's') as mgr:\n"
            "    try:\n"
            "        mgr.save(state, 1)\n"
            "    except TypeError as exc:\n"
            "        print('refused:', exc)\n")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "storage" in proc.stdout, proc.stdout
    assert "layer/w" in proc.stdout, proc.stdout


def test_a_tensor_of_a_kind_no_shard_holds_is_refused_naming_its_key(tmp_path: Path) -> None:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with LocalCheckpointManager(tmp_path / "ckpt", "s") as mgr:
        with pytest.raises(TypeError, match=r"'layer/q'.*dequantize"):
            mgr.save({"layer": {"q": q}, "w": torch.ones(2)}, 1)
        mgr.save({"w": torch.ones(2)}, 1)  # nothing of the refused save is in the way


class _MasterWeightsSGD(torch.optim.SGD):
    """An optimizer subclass whose state_dict() writes its master weights into the flat buffer
    the model's parameters view (Megatron's and FSDP's pattern): the parameters' version
    counters do not move, the buffer's does."""

    def __init__(self, params: Any, flat: torch.Tensor) -> None:
        super().__init__(params, lr=0.1)
        self.flat, self.master = flat, flat.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        with torch.no_grad():
            self.flat.copy_(self.master)
        return super().state_dict()


class _Renorm(torch.nn.Module):
    """state_dict() changes a shared table through .data (no version bump)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        self.table.data.div_(4.0)
        return {"table": self.table}


class _Transposes(torch.nn.Module):
    """state_dict() points a tensor met before at a transposed view of its own memory: same
    address, size and version."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = w

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        self.w.data = self.w.data.t()
        return {}


def test_a_save_holds_what_every_state_dict_call_left_not_an_early_copy(tmp_path: Path) -> None:
    """From the second save on, large tensors are copied as the walk meets them; a Stateful's
    state_dict() run later may change them. Changes that move no version counter (writes through
    a flat buffer the parameters view, through .data) or that keep address, size and version
    (.data = a transposed view) kept the early copy: the checkpoint held the weights of one
    step before, or scrambled rows. Every iteration must hold the values after the walk."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 512, bias=False))
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    model[0].weight.data = flat.view(512, 1024)
    opt = _MasterWeightsSGD(model.parameters(), flat)
    table = torch.nn.Parameter(torch.ones(1 << 20))
    with LocalCheckpointManager(tmp_path / "root", "s", keep_last=1) as mgr:
        for it in (1, 2, 3):
            opt.master.fill_(float(it))
            table.data.fill_(float(it))
            w = torch.nn.Parameter(torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)
                                   + it)
            state = {"model": model, "optimizer": opt, "emb": table, "renorm": _Renorm(table),
                     "w": w, "t": _Transposes(w)}
            request = mgr.save(state, it, is_async=True)
            want = {"weight": flat.view(512, 1024).clone(), "table": table.detach().clone(),
                    "w": w.detach().clone()}
            flat.fill_(-1.0)  # training goes on
            table.data.fill_(-1.0)
            request.execute_sync()
            got, _ = mgr.load(iteration=it)
            assert torch.equal(got["model"]["0.weight"], want["weight"]), it
            assert torch.equal(got["emb"], want["table"]) and \
                torch.equal(got["renorm"]["table"], want["table"]), it
            assert torch.equal(got["w"], want["w"]), it


class _Hooky(torch.Tensor):
    """A buffer whose detach() (torch's Module._save_to_state_dict calls it) runs user code."""

    target: torch.Tensor | None = None
    value = 0.0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.Tensor.detach and cls.target is not None:
            cls.target.data.fill_(cls.value)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {})).as_subclass(torch.Tensor)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("how", ["module_instance", "child_instance", "optimizer_instance",
                                 "buffer_subclass"])
def test_user_code_that_torch_state_dict_runs_is_not_trusted(tmp_path: Path, how: str) -> None:
    """Code run by a Stateful's state_dict() that looks like torch's own: a method patched onto
    the instance (of the Stateful or of a module below it) or a buffer's __torch_function__.
    Each wrote a tensor met before through .data, and saves from the second on kept its early
    copy (from a review of the fix before)."""
    big = torch.nn.Parameter(torch.zeros(1 << 20))
    step = {"value": 0.0}

    def write() -> None:
        big.data.fill_(step["value"])

    obj: Any
    if how in ("module_instance", "child_instance"):
        obj = torch.nn.Sequential(torch.nn.Linear(4, 4))
        owner = obj if how == "module_instance" else obj[0]
        real = owner.state_dict

        def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
            write()
            return real(*args, **kwargs)
        owner.state_dict = types.MethodType(patched, owner)
    elif how == "optimizer_instance":
        obj = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
        real_opt = obj.state_dict

        def patched_opt(self: Any) -> Any:
            write()
            return real_opt()
        obj.state_dict = types.MethodType(patched_opt, obj)
    else:
        obj = torch.nn.Linear(4, 4)
        obj.register_buffer("hooky", torch.zeros(4, 4).as_subclass(_Hooky))
        _Hooky.target = big
    try:
        with LocalCheckpointManager(tmp_path / "root", "s", keep_last=1) as mgr:
            for it in (1, 2, 3):
                step["value"] = _Hooky.value = float(it)
                big.data.fill_(-7.0)
                request = mgr.save({"big": big, "obj": obj}, it, is_async=True)
                big.data.fill_(-1.0)  # training goes on
                request.execute_sync()
                got, _ = mgr.load(iteration=it)
                assert torch.equal(got["big"], torch.full((1 << 20,), float(it))), \
                    (it, float(got["big"][0]))
    finally:
        _Hooky.target = None
