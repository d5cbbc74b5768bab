"""load(into=state_dict): saved tensors land in the caller's tensors in place (same objects,
no allocation on CPU), with a fresh tensor wherever the caller's does not fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import into_scenarios
import pytest
import torch
from dist_harness import run_python, run_ranks

from localckpt import LocalCheckpointManager
from localckpt.errors import ConfigurationError, CorruptShardError
from localckpt.storage import shard_reader


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 200, generator=g),
                      "b": torch.randn(200, generator=g).to(torch.bfloat16),
                      "mask": torch.rand(40, generator=g) > 0.5},
            "optimizer": {"state": {0: {"step": torch.tensor(7.0),
                                        "exp_avg": torch.randn(300, 200, generator=g)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "step": 7}


def _zeros_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else state


def test_tensors_are_loaded_into_the_callers_own(root: Path) -> None:
    saved = _state(1)
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    template = _zeros_like(saved)
    template["model"]["b"] = torch.zeros(199, dtype=torch.bfloat16)  # another shape: not used
    wrong_shape = template["model"]["b"]
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, ckpt = mgr.load(into=template)
    assert ckpt[0] == 1
    for path in (("model", "w"), ("model", "mask"), ("optimizer", "state", 0, "exp_avg"),
                 ("optimizer", "state", 0, "step")):
        got, mine, want = loaded, template, saved
        for k in path:
            got, mine, want = got[k], mine[k], want[k]
        assert got is mine and torch.equal(got, want), path  # the caller's tensor, filled
    assert loaded["model"]["b"] is not wrong_shape and torch.equal(loaded["model"]["b"],
                                                                     saved["model"]["b"])
    assert torch.count_nonzero(wrong_shape) == 0  # left alone
    assert loaded["step"] == 7 and loaded["optimizer"]["param_groups"] == [{"lr": 0.1,
                                                                             "params": [0]}]


def test_tensors_sharing_memory_are_not_read_into(root: Path) -> None:
    saved = {"embed": torch.randn(64, 32), "head": torch.randn(64, 32), "x": torch.randn(5)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    tied = torch.zeros(64, 32)
    template = {"embed": tied, "head": tied, "x": torch.zeros(5)}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=template)
    assert loaded["x"] is template["x"]
    assert loaded["embed"] is not tied and loaded["head"] is not tied
    assert torch.equal(loaded["embed"], saved["embed"]) and torch.equal(loaded["head"],
                                                                          saved["head"])


def test_only_overlapping_destinations_are_left_out(root: Path) -> None:
    saved = {"a": torch.randn(10), "b": torch.randn(10), "c": torch.randn(10),
             "d": torch.randn(70)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    base = torch.zeros(100)
    into = {"a": base[0:10], "b": base[10:20], "c": base[15:25], "d": base[30:100]}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    assert [loaded[k] is into[k] for k in "abcd"] == [True, False, False, True]
    assert all(torch.equal(loaded[k], saved[k]) for k in "abcd")


def test_interleaved_views_that_share_no_memory_are_read_into(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Column slices of one matrix (a fused weight split along dim 1) and the even and odd
    elements of one buffer span each other's memory without sharing any of it: they were taken
    for tensors overlapping in part, left out without a word, and the caller's matrix kept its
    old values (from the attacker review of load(into=...)). Tensors that do overlap in part
    still come back fresh, now with a warning naming them."""
    saved = {"q": torch.randn(4, 4), "k": torch.randn(4, 4), "even": torch.randn(6),
             "odd": torch.randn(6), "x": torch.randn(4, 5), "y": torch.randn(4, 5)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    fused, buf, third = torch.zeros(4, 8), torch.zeros(12), torch.zeros(4, 8)
    q, k = fused.split(4, dim=1)
    into = {"q": q, "k": k, "even": buf[::2], "odd": buf[1::2], "x": third[:, :5],
            "y": third[:, 3:]}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    assert {k: loaded[k] is into[k] for k in into} == {
        "q": True, "k": True, "even": True, "odd": True, "x": False, "y": False}
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert torch.equal(fused, torch.cat([saved["q"], saved["k"]], dim=1))
    assert "'x', 'y'" in caplog.text and "overlap in part" in caplog.text


def test_tied_pairs_that_interleave_are_each_filled_in_place(root: Path) -> None:
    """Two pairs of tied keys on the even and the odd columns of one matrix share no memory
    with each other: their address spans overlap, and both pairs were left out (from the
    attacker review of this session's diff)."""
    src = torch.arange(24.0).reshape(4, 6)
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"a1": src[:, 0::2], "a2": src[:, 0::2], "c1": src[:, 1::2],
                  "c2": src[:, 1::2]}, 1)
    m = torch.zeros(4, 6)
    into = {"a1": m[:, 0::2], "a2": m[:, 0::2], "c1": m[:, 1::2], "c2": m[:, 1::2]}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    assert all(loaded[k] is into[k] for k in into)
    assert torch.equal(m, src)


def test_a_node_loss_restore_receives_into_the_callers_tensors(tmp_path: Path,
                                                               root: Path) -> None:
    assert all(r.ok for r in run_ranks(into_scenarios.save, 2, tmp_path, str(root)))
    import shutil
    shutil.rmtree(root / "node1")
    for r in run_ranks(into_scenarios.load_into, 2, tmp_path, str(root), -1):
        assert r.ok, r.message
        assert r.value == {"identical": True, "in_place": True}


def test_a_node_loss_restore_refuses_a_read_only_into_on_every_rank(tmp_path: Path,
                                                                    root: Path) -> None:
    """Received bytes were written into `into`'s memory by gloo and by a memmove: into a
    read-only mapping, that killed the receiving rank (SIGSEGV)."""
    assert all(r.ok for r in run_ranks(into_scenarios.save, 2, tmp_path, str(root)))
    import shutil
    shutil.rmtree(root / "node1")
    for r in run_ranks(into_scenarios.read_only_into, 2, tmp_path, str(root), str(tmp_path)):
        assert r.ok, r.message
        assert "ConfigurationError" in r.value and "'big'" in r.value \
            and "read-only" in r.value, r.value


def test_a_bad_into_on_one_rank_is_the_same_error_on_every_rank(tmp_path: Path,
                                                                root: Path) -> None:
    assert all(r.ok for r in run_ranks(into_scenarios.save, 2, tmp_path, str(root)))
    for r in run_ranks(into_scenarios.load_into, 2, tmp_path, str(root), 1):
        assert r.raised("TypeError"), (r.error, r.message)
        assert "rank 1" in r.message and "object" in r.message


def test_views_the_read_cannot_fill_are_filled_by_a_copy(root: Path) -> None:
    saved = {"img": torch.randn(2, 3, 8, 8), "z": torch.randn(6, dtype=torch.complex64),
             "empty": torch.zeros(0, 3), "p": torch.randn(4)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    into = {"img": torch.zeros(2, 3, 8, 8).to(memory_format=torch.channels_last),
            "z": torch.zeros(6, dtype=torch.complex64).conj(),  # a lazy conjugate view
            "empty": torch.zeros(0, 3), "p": torch.nn.Parameter(torch.zeros(4))}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    for k in saved:
        assert loaded[k] is into[k] and torch.equal(loaded[k].detach(), saved[k]), k
    assert into["img"].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("numel,case", [(1 << 16, "read into"), (100, "read into"),
                                        (1 << 16, "copied into")])
def test_a_read_only_destination_is_refused_naming_its_key(root: Path, numel: int,
                                                           case: str) -> None:
    """A read-only mapping in `into`: read into, the read failed with EFAULT; copied into (a
    transposed view), the copy killed the process. Refused before anything is read, naming
    the key, and the copy is not quarantined."""
    import mmap
    import warnings
    backing = root / "read-only.bin"
    backing.write_bytes(bytes(numel * 4))
    with open(backing, "rb") as f:
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns about the non-writable buffer
        read_only = torch.frombuffer(pages, dtype=torch.float32)
    if case == "copied into":
        read_only = read_only.view(4, numel // 4).t()
    saved = {"w": torch.randn(read_only.shape), "v": torch.randn(8)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    with LocalCheckpointManager(root, "s") as mgr:
        with pytest.raises(ConfigurationError, match="key 'w' is read-only memory"):
            mgr.load(into={"w": read_only, "v": torch.zeros(8)})
        loaded, _ = mgr.load()  # the copy was not quarantined
    assert torch.equal(loaded["w"], saved["w"])


def test_a_destination_changed_while_load_runs_is_blamed_not_the_copy(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {"w": torch.randn(1 << 16), "v": torch.randn(100)}
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        mgr.save(saved, 1)
        mgr.save(saved, 2)
    into = {"w": torch.zeros(1 << 16), "v": torch.zeros(100)}
    lo = into["w"].data_ptr()
    real = shard_reader._preadv_all

    def meddling(fd: int, pieces: list[memoryview], offset: int) -> int:
        got = real(fd, pieces, offset)
        if into["w"].data_ptr() == lo:  # another thread writes the caller's tensor meanwhile
            into["w"][7] += 1.0
        return got

    monkeypatch.setattr(shard_reader, "_preadv_all", meddling)
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr, \
            pytest.raises(ConfigurationError, match="changed by another thread"):
        mgr.load(into=into)
    monkeypatch.undo()
    assert not list((root / "s").glob(".quarantine-*"))  # no healthy copy was moved aside
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        loaded, ckpt = mgr.load()
    assert ckpt[0] == 2 and torch.equal(loaded["w"], saved["w"])


def test_small_tensors_across_windows_and_chunks_load_exactly(root: Path) -> None:
    # Sizes around the copy-out limit, packed across 1 MiB read windows and 1.5 MB chunks;
    # some loaded into the caller's tensors (read directly), the others fresh (copied out).
    from localckpt.storage.views import COPY_OUT_MAX_NBYTES

    g = torch.Generator().manual_seed(0)
    numels = [1, 3, 1000, COPY_OUT_MAX_NBYTES // 4 - 1, COPY_OUT_MAX_NBYTES // 4,
              COPY_OUT_MAX_NBYTES // 4 + 1, 50_000]
    saved = {f"t{i}": torch.randn(numels[i % len(numels)], generator=g) for i in range(700)}
    saved["i8"] = torch.randint(-100, 100, (4097,), dtype=torch.int8, generator=g)
    with LocalCheckpointManager(root, "s", chunk_nbytes=1_500_000) as mgr:
        mgr.save(saved, 1)
    into: dict[str, Any] = {k: torch.zeros_like(v) for k, v in saved.items() if k[-1] in "05"}
    for given in ({}, into):
        with LocalCheckpointManager(root, "s") as mgr:
            loaded, _ = mgr.load(into=given or None)
        for k, v in saved.items():
            assert torch.equal(loaded[k], v), k
            assert (loaded[k] is into.get(k)) == (given is into and k in into), k


def test_a_damaged_byte_among_small_tensors_is_caught(root: Path) -> None:
    saved = {f"t{i}": torch.full((100,), float(i)) for i in range(50)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    [chunk] = [p for p in root.rglob("c/0")]
    data = bytearray(chunk.read_bytes())
    data[64 * 30 + 5] ^= 1  # inside a small tensor's bytes
    chunk.write_bytes(bytes(data))
    with LocalCheckpointManager(root, "s") as mgr, pytest.raises(CorruptShardError):
        mgr.load()


def test_tied_host_tensors_of_into_are_filled_in_place(root: Path) -> None:
    """A model with tied weights (embedding and head share one tensor): load(into=its state
    dict) must leave the model holding the saved weights, as it does for every other tensor
    (the shared tensor was left at its initial values)."""
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    with torch.no_grad():
        emb.weight.copy_(torch.arange(40.0).view(10, 4))
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"model": model.state_dict()}, 1)
    with torch.no_grad():
        emb.weight.zero_()
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into={"model": model.state_dict()})
    assert torch.equal(model["emb"].weight.detach(), torch.arange(40.0).view(10, 4))
    assert torch.equal(loaded["model"]["head.weight"], torch.arange(40.0).view(10, 4))


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_one_memory_seen_through_a_lazy_bit_is_no_tied_weight(root: Path, view: str) -> None:
    """w and w.conj() (or a negative view) under two keys were taken for tied weights: filled
    by one copy each, the second undid the first, and the returned tensor did not hold the
    saved value (from the attacker review of the state dict round trip)."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"a": x.clone(), "b": x.clone()}, 1)
    w = torch.zeros(2, dtype=torch.complex64)
    other = w.conj() if view == "conj" else torch._neg_view(w)
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into={"a": w, "b": other})
    assert torch.equal(loaded["a"], x) and torch.equal(loaded["b"], x)


@pytest.mark.parametrize("case", ["shrunk", "freed view"])
def test_an_into_tensor_whose_storage_is_too_small_is_refused(root: Path, case: str) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"w": torch.full((1 << 14,), 3.0)}, 1)
    code = (
        "import torch\n"
        "from localckpt import LocalCheckpointManager\n"
        + ("t = torch.zeros(1 << 14); t.untyped_storage().resize_(8)\n" if case == "shrunk" else
           "b = torch.zeros(1 << 15); t = b[1 << 14:]; b.untyped_storage().resize_(0)\n")
        + f"with LocalCheckpointManager({str(root)!r}, 's') as mgr:\n"
        "    try:\n"
        "        mgr.load(into={'w': t})\n"
        "    except Exception as exc:\n"
        "        print('refused:', type(exc).__name__, exc)\n")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "storage" in proc.stdout, proc.stdout


def test_tied_into_tensors_saved_with_different_values_come_back_apart(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = {"embed": torch.full((8,), 1.0), "head": torch.full((8,), 2.0)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    tied = torch.zeros(8)
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into={"embed": tied, "head": tied})
    assert torch.equal(loaded["embed"], saved["embed"]) and torch.equal(loaded["head"],
                                                                          saved["head"])
    assert torch.equal(tied, torch.zeros(8))  # left as it was: neither key's value is its own
    assert "'embed', 'head' share memory" in caplog.text


def test_a_resharding_load_into_refuses_a_shrunk_tensor_and_keeps_tied_keys_apart(
        tmp_path: Path) -> None:
    """The resharding load copied into `into`'s tensors with no check: past a shrunk storage
    or into read-only memory (crashes), and the last of two tied keys saved apart winning for
    both."""
    base = str(tmp_path / "roots")
    assert all(r.ok for r in run_ranks(into_scenarios.save_apart, 2, tmp_path, base))
    (r,) = run_ranks(into_scenarios.reshard_into, 1, tmp_path, base, "shrunk")
    assert r.ok and "storage holds 8 bytes" in r.value["error"], (r.value, r.message)
    (r,) = run_ranks(into_scenarios.reshard_into, 1, tmp_path, base, "read-only")
    assert r.ok and "key 'w' is read-only memory" in r.value["error"], (r.value, r.message)
    (r,) = run_ranks(into_scenarios.reshard_into, 1, tmp_path, base, "tied")
    assert r.ok, r.message
    assert r.value == {"emb": 0.0, "head": 5.0, "apart_untouched": True,
                       "tied_in_place": True}, r.value
    # one whose elements are one memory location is not written (one value for all)
    (r,) = run_ranks(into_scenarios.reshard_into, 1, tmp_path, base, "expanded")
    assert r.ok and r.value == {"fresh": True, "w": [1.0], "untouched": True}, (r.value,
                                                                                  r.message)
    # a freed tensor of into the checkpoint holds nothing for is not in the way
    (r,) = run_ranks(into_scenarios.reshard_into, 1, tmp_path, base, "freed elsewhere")
    assert r.ok and r.value == {"w_in_place": True}, (r.value, r.message)


def test_tied_tensors_holding_nan_are_filled_in_place(root: Path) -> None:
    w = torch.tensor([1.0, float("nan"), 3.0])
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"emb": w, "head": w}, 1)
    tied = torch.zeros(3)
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into={"emb": tied, "head": tied})
    assert loaded["emb"] is tied and loaded["head"] is tied
    assert torch.equal(tied.isnan(), w.isnan()) and tied[0] == 1.0 and tied[2] == 3.0


_READ_INTO_GIVEN = r"""
import mmap, sys, warnings
import torch
from localckpt import LocalCheckpointManager
from localckpt.storage import tensor_reads
root, case = sys.argv[1], sys.argv[2]
saved = {"a": torch.arange(100.0), "b": torch.arange(200.0)}
with LocalCheckpointManager(root, "s") as mgr:
    mgr.save(saved, 1)
    if case in ("read-only", "a file mapping cut short"):
        if case == "read-only":
            pages = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ)
        else:  # writable, but its file shortened by another process: a memmove gets SIGBUS
            import os, tempfile
            fd, _ = tempfile.mkstemp(dir=root)
            os.ftruncate(fd, mmap.PAGESIZE)
            pages = mmap.mmap(fd, mmap.PAGESIZE)
            os.ftruncate(fd, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            b = torch.frombuffer(pages, dtype=torch.float32)[:200]
    elif case == "strided":
        b = torch.zeros(400)[::2]
    else:
        b = torch.zeros(200)
    if case == "maps unreadable":
        tensor_reads.writable_memory = lambda **_: None
    given = [torch.zeros(100), b]
    (ref,) = mgr._ctx.store.committed()
    try:
        _, got = mgr._ctx.store.read_tensors(ref, lambda m: given)
    except Exception as exc:
        print("raised", type(exc).__name__)
    else:
        print("same", got[0] is given[0] and got[1] is given[1]
              and all(torch.equal(g, saved[k]) for g, k in zip(got, "ab")))
"""


@pytest.mark.parametrize("case,says", [("writable", "same True"),
                                       ("maps unreadable", "same True"),
                                       ("read-only", "raised"),
                                       ("a file mapping cut short", "raised"),
                                       ("strided", "raised ValueError")])
def test_small_given_tensors_are_filled_and_read_only_memory_never_kills(
        root: Path, case: str, says: str) -> None:
    """Small given tensors are filled by a copy out of the chunk read (not a read into each),
    once /proc/self/maps says their memory is private anonymous memory this process may write;
    where it cannot tell, or a tensor is read-only or a file's mapping (cut short, a memmove
    gets SIGBUS), they are read into, which fails with EFAULT instead of killing the process. A
    strided one is refused as the contract says (it was written from its first byte on)."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _READ_INTO_GIVEN, str(root), case],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip().startswith(says), (proc.stdout, proc.stderr[-2000:])


@pytest.mark.parametrize("make", [lambda: torch.zeros(5).unfold(0, 2, 1),
                                  lambda: torch.zeros(1).expand(4, 2)],
                         ids=["overlapping windows", "expanded"])
def test_a_destination_whose_elements_share_memory_is_not_loaded_into(
        root: Path, make: Any) -> None:
    """A tensor of `into` some of whose elements are one memory location cannot hold the saved
    values: the copy into it wrote [[0, 2], [2, 4], ...] for [[0, 1], [2, 3], ...] and returned
    it as loaded, or raised. It is left alone, as one of another shape is, and the value comes
    back in a fresh tensor."""
    saved = {"w": torch.arange(8.0).reshape(4, 2), "v": torch.randn(3)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    into = {"w": make(), "v": torch.zeros(3)}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    assert loaded["w"] is not into["w"] and torch.equal(loaded["w"], saved["w"])
    assert loaded["v"] is into["v"] and torch.equal(into["v"], saved["v"])


def test_strided_destinations_whose_elements_are_apart_are_filled_in_place(root: Path) -> None:
    """A column slice and a stepped view hold their values in memory of their own, though
    torch cannot tell cheaply (its overlap check answers "too hard"): they must still be filled
    (the check of b37183c left them alone)."""
    saved = {"w": torch.arange(16.0).view(4, 4), "x": torch.arange(4.0),
             "t": torch.arange(6.0).view(2, 3)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    big, buf, square = torch.zeros(4, 8), torch.zeros(8), torch.zeros(3, 2)
    into = {"w": big[:, :4], "x": buf[::2], "t": square.t()}
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=into)
    for k in saved:
        assert loaded[k] is into[k] and torch.equal(into[k], saved[k]), k
