"""DTensor layouts in the manifest, and Stateful objects, without processes: the recorded layout
round-trips and is checked like every other manifest field; objects with state_dict() /
load_state_dict() are saved through them and restored in place."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from localckpt import BasicTensorAwareStateDict, LocalCheckpointManager
from localckpt.dtensors import DTensorLayout, placement_from_str
from localckpt.errors import ConfigurationError, CorruptShardError
from localckpt.storage.manifest import FORMAT_VERSION, ShardManifest, TensorEntry, _crc_of

LAYOUT = DTensorLayout(global_shape=(16, 8), global_stride=(8, 1), mesh_shape=(2, 2),
                       mesh_dim_names=("dp", "tp"), placements=("SS(0,2)", "S(0)"),
                       coordinate=(1, 0), offset=(4, 0))


def _manifest(layout: Any = None, shape: tuple[int, ...] = (4, 8)) -> ShardManifest:
    return ShardManifest(
        session_id="s", iteration=3, owner_rank=2, world_size=4,
        tensors=(TensorEntry("model/w", "float32", shape, 0, 4 * 32, "cpu"),),
        hollow={"dict": [["model", {"dict": [["w", {"DT": {
            "T": 0, "layout": LAYOUT.to_json() if layout is None else layout}}]]}]]},
        container="plain", data_nbytes=128, chunk_nbytes=128, chunk_count=1,
        chunk_crc32c=(1,), created_unix=1.0)


def _reparsed(m: ShardManifest) -> ShardManifest:
    return ShardManifest.from_json_dict(json.loads(json.dumps(m.to_json_dict())), "shard-x")


def test_layout_round_trips_through_the_manifest() -> None:
    m = _reparsed(_manifest())
    assert m.format_version == FORMAT_VERSION
    assert m.layouts == {0: LAYOUT}
    assert DTensorLayout.from_json(json.loads(json.dumps(LAYOUT.to_json()))) == LAYOUT


def test_placements_round_trip_including_strided_shards() -> None:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    assert placement_from_str("R") == Replicate()
    assert placement_from_str("S(1)") == Shard(1)
    assert placement_from_str("SS(0,2)") == _StridedShard(0, split_factor=2)
    with pytest.raises(ValueError, match="P"):
        placement_from_str("P(sum)")


def _layout(shape: int, placements: tuple[str, ...], coordinate: tuple[int, ...],
            offset: int) -> DTensorLayout:
    return DTensorLayout((shape,), (1,), (2, 2), None, placements, coordinate, (offset,))


def test_a_strided_shard_is_a_block_only_where_its_indices_are_contiguous() -> None:
    # FSDP2 over tensor parallelism: rank (dp=i, tp=j) holds rows 4j+2i, 4j+2i+1
    for i in (0, 1):
        for j in (0, 1):
            assert _layout(8, ("SS(0,2)", "S(0)"), (i, j), 4 * j + 2 * i).is_block
    # a (Shard(0), Shard(1)) 4x4 tensor seen flat: rank (0, 0) holds 0, 1, 4, 5
    assert not _layout(16, ("S(0)", "SS(0,2)"), (0, 0), 0).is_block
    assert _layout(16, ("S(0)", "S(0)"), (1, 1), 12).is_block


def _held_by_torch(layout: DTensorLayout, dim: int) -> torch.Tensor:
    """The global indices of ``dim`` a rank holds, cut by torch's own placements (the oracle)."""
    held = torch.arange(layout.global_shape[dim])
    for i, text in enumerate(layout.placements):
        placement = placement_from_str(text)
        if text != "R" and placement.dim == dim:
            chunks, _ = placement._split_tensor(held, layout.mesh_shape[i], with_padding=False)
            c = layout.coordinate[i]
            held = chunks[c] if c < len(chunks) else held[:0]
    return held


def test_is_block_agrees_with_torchs_own_cuts() -> None:
    import itertools
    import random

    rng = random.Random(7)
    kinds = ["R", "S(0)", "SS(0,1)", "SS(0,2)", "SS(0,3)", "SS(0,5)"]
    checked = 0
    for _ in range(400):
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        placements = tuple(rng.choice(kinds) for _ in mesh)
        if not any(p.startswith("SS") for p in placements):
            continue
        n = rng.randint(0, 24)
        for coordinate in itertools.product(*(range(m) for m in mesh)):
            layout = DTensorLayout((n,), (1,), mesh, None, placements, coordinate, (0,))
            held = _held_by_torch(layout, 0)
            start = int(held[0]) if len(held) else 0
            for offset in {start, start + 1}:
                shifted = DTensorLayout((n,), (1,), mesh, None, placements, coordinate,
                                        (offset,))
                expected = torch.equal(held, torch.arange(offset, offset + len(held)))
                assert shifted.is_block == expected, (n, mesh, placements, coordinate, offset)
                checked += 1
    assert checked > 500


def _within(seconds: float) -> Any:
    """A context that raises TimeoutError in this (main) thread after ``seconds``."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def deadline() -> Any:
        def expire(*_: Any) -> None:
            raise TimeoutError(f"took over {seconds} s")
        old = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    return deadline()


def test_is_block_of_a_huge_strided_dim_needs_no_memory_of_its_size() -> None:
    # A forged (or enormous) global shape: its indices are never materialized (8 TiB here).
    with _within(5):
        for i in (0, 1):
            for j in (0, 1):
                assert _layout(1 << 40, ("SS(0,2)", "S(0)"), (i, j), (4 * j + 2 * i) << 37) \
                    .is_block
        assert not _layout(1 << 40, ("S(0)", "SS(0,2)"), (0, 0), 0).is_block


def test_a_huge_split_factor_is_refused_at_parse() -> None:
    # A forged split factor would cut a dim into a billion pieces, one at a time.
    doc = json.loads(json.dumps(_manifest(
        {**LAYOUT.to_json(), "placements": ["SS(0,999999999)", "S(0)"]}).to_json_dict()))
    with _within(5), pytest.raises(CorruptShardError, match="split factor"):
        ShardManifest.from_json_dict(doc, "shard-x")


def test_same_place_ignores_dim_names_only() -> None:
    renamed = DTensorLayout(**{**LAYOUT.__dict__, "mesh_dim_names": ("a", "b")})
    moved = DTensorLayout(**{**LAYOUT.__dict__, "coordinate": (0, 0)})
    assert LAYOUT.same_place(renamed) and not LAYOUT.same_place(moved)


@pytest.mark.parametrize(("edit", "why"), [
    ({"placements": ["S(0)"]}, "placements"),  # one per mesh dim
    ({"placements": ["S(2)", "R"]}, "placement 'S(2)'"),  # no dim 2 in a 2-d tensor
    ({"placements": ["P(sum)", "R"]}, "placement"),
    ({"coordinate": [2, 0]}, "off the mesh"),
    ({"offset": [14, 0]}, "does not fit"),  # 4 rows at 14 run past 16
    ({"global_shape": [16]}, "differ in length"),
    ({"mesh_shape": "2x2"}, "mesh_shape"),
    ({"mesh_dim_names": [1, 2]}, "mesh_dim_names"),
    ({"global_stride": None}, "global_stride"),
])
def test_a_bad_layout_is_a_corrupt_manifest(edit: dict[str, Any], why: str) -> None:
    m = _manifest({**LAYOUT.to_json(), **edit})
    doc = json.loads(json.dumps(m.to_json_dict()))
    with pytest.raises(CorruptShardError, match="shard-x") as info:
        ShardManifest.from_json_dict(doc, "shard-x")
    assert why in str(info.value)


def test_a_layout_without_its_tensor_is_corrupt() -> None:
    m = _manifest()
    doc = json.loads(json.dumps(m.to_json_dict()))
    node = doc["manifest"]["hollow"]["dict"][0][1]["dict"][0][1]
    node["DT"]["T"] = 5
    doc["crc32c"] = _crc_of(doc["manifest"])
    with pytest.raises(CorruptShardError, match="tensor 5 of 1"):
        ShardManifest.from_json_dict(doc, "shard-x")


def test_a_version_1_manifest_still_reads() -> None:
    doc = json.loads(json.dumps(ShardManifest(
        session_id="s", iteration=1, owner_rank=0, world_size=1,
        tensors=(TensorEntry("w", "float32", (2,), 0, 8, "cpu"),),
        hollow={"dict": [["w", {"T": 0}]]}, container="plain", data_nbytes=8,
        chunk_nbytes=8, chunk_count=1, chunk_crc32c=(1,), format_version=1).to_json_dict()))
    m = ShardManifest.from_json_dict(doc, "old")
    assert m.format_version == 1 and m.layouts == {}


# ------------------------------------------------------------------ Stateful objects


class Loader:
    """A data loader that knows its position (the Stateful protocol, nothing more)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "epoch": "e1"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def _job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Loader]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched, Loader()


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, sched: Any, loader: Loader,
           steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(loader.position))
        loader.position += 1
        loss = model(x).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def test_stateful_objects_are_saved_and_restored_in_place(root: Path) -> None:
    model, optim, sched, loader = _job(0)
    _train(model, optim, sched, loader, 3)
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"model": model, "optim": optim, "sched": sched, "loader": loader, "step": 3}, 3)
    saved_optim = copy.deepcopy(optim.state_dict())
    reference = _train(model, optim, sched, loader, 3)

    fresh = _job(1)  # other weights, no optimizer state, schedule and loader at the start
    into = dict(zip(("model", "optim", "sched", "loader"), fresh, strict=True))
    with LocalCheckpointManager(root, "s") as mgr:
        state, _ = mgr.load(into={**into, "step": 0})
    assert all(state[k] is into[k] for k in into) and state["step"] == 3
    assert fresh[3].position == 3 and fresh[2].last_epoch == 3
    got = fresh[1].state_dict()
    for key, per_param in saved_optim["state"].items():
        for name, value in per_param.items():
            assert torch.equal(got["state"][key][name], value), (key, name)
    assert _train(*fresh, 3) == reference


def test_without_into_stateful_objects_come_back_as_their_state_dicts(root: Path) -> None:
    model, optim, sched, loader = _job(0)
    _train(model, optim, sched, loader, 2)
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"model": model, "loader": loader}, 1)
        state, _ = mgr.load()
    assert state["loader"] == {"position": 2, "epoch": "e1"}
    assert state["model"].keys() == model.state_dict().keys()
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())


def test_a_stateful_with_an_unsupported_leaf_names_its_path(root: Path) -> None:
    class Bad(Loader):
        def state_dict(self) -> dict[str, Any]:
            return {"handle": object()}

    with LocalCheckpointManager(root, "s") as mgr, pytest.raises(TypeError) as info:
        mgr.save({"loader": Bad()}, 1)
    assert "'loader/handle'" in str(info.value)


def test_a_stateful_is_restored_from_a_plain_state_dict_saved_at_its_path(root: Path) -> None:
    """A checkpoint written before Stateful objects were accepted (their state dicts saved)
    restores the objects passed in ``into``; one the checkpoint has nothing for is named."""
    model, _, _, loader = _job(0)
    loader.position = 7
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"model": model.state_dict(), "loader": loader.state_dict()}, 1)
    model2, _, sched2, loader2 = _job(1)
    with LocalCheckpointManager(root, "s") as mgr:
        state, _ = mgr.load(into={"model": model2, "loader": loader2})
        assert state["loader"] is loader2 and loader2.position == 7
        assert state["model"] is model2
        assert all(torch.equal(a, b) for a, b in zip(model2.state_dict().values(),
                                                     model.state_dict().values(), strict=True))
        with pytest.raises(ConfigurationError, match=r"\['sched'\]"):
            mgr.load(into={"model": model2, "loader": loader2, "sched": sched2})


class Box:
    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class App:
    """A Stateful holding another one in its state dict (restores it itself)."""

    def __init__(self, value: Any) -> None:
        self.box = Box(value)

    def state_dict(self) -> dict[str, Any]:
        return {"box": self.box}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.box.load_state_dict(state["box"])


def test_a_stateful_within_a_stateful_gets_plain_state(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"app": App("saved")}, 1)
        fresh = App("fresh")
        state, _ = mgr.load(into={"app": fresh})
    assert state["app"] is fresh and fresh.box.value == "saved"


@pytest.mark.parametrize("state", [
    {"a/b": Box(1), "a": {"b": Box(2)}},  # two objects, one key path
    {1: Box(1), "1": Box(2)},
    {"loop": "self"},  # a Stateful whose state dict holds itself
])
def test_ambiguous_or_cyclic_statefuls_are_refused_naming_the_path(root: Path,
                                                                  state: dict[Any, Any]) -> None:
    if state.get("loop") == "self":
        class Loop(Box):
            def state_dict(self) -> dict[str, Any]:
                return {"me": self}
        state = {"loop": Loop(0)}
    with LocalCheckpointManager(root, "s") as mgr, pytest.raises(TypeError) as info:
        mgr.save(state, 1)
    assert "Stateful" in str(info.value) and ("'a/b'" in str(info.value)
                                              or "'1'" in str(info.value)
                                              or "'loop/me'" in str(info.value))


def test_tensors_of_into_that_overlap_are_left_out_whatever_their_layout(root: Path) -> None:
    saved = {"c": torch.arange(12.0).reshape(3, 4), "d": torch.full((4, 3), -1.0)}
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
        base = torch.zeros(3, 4)
        state, _ = mgr.load(into={"c": base, "d": base.t()})  # d is a view of c's memory
    assert state["c"] is not base and state["d"] is not base
    assert torch.equal(state["c"], saved["c"]) and torch.equal(state["d"], saved["d"])
    assert torch.equal(base, torch.zeros(3, 4))


def test_plain_state_dicts_are_written_as_version_1_readable_by_the_last_release(
        root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"w": torch.ones(2)}, 1)
        mgr.save({"loader": Loader()}, 2)
    versions = {p.parent.name: json.loads(p.read_text())["attributes"]["localckpt"]["manifest"][
        "format_version"] for p in (root / "s").glob("iter_*/rank_*/zarr.json")}
    assert sorted(versions.values()) == [2] and len(versions) == 1  # keep_last=1
    with LocalCheckpointManager(root, "t", keep_last=2) as mgr:
        mgr.save({"w": torch.ones(2)}, 1)
        mgr.save({"loader": Loader()}, 2)
    versions = {p.parent.parent.name: json.loads(p.read_text())["attributes"]["localckpt"][
        "manifest"]["format_version"] for p in (root / "t").glob("iter_*/rank_*/zarr.json")}
    assert versions == {"iter_0000000001": 1, "iter_0000000002": 2}


@pytest.mark.parametrize(("hollow", "why"), [
    ({"dict": [["w", {"DT": None}]]}, "DTensor node"),
    ({"dict": [["w", {"f": 5}]]}, "malformed"),
    ({"dict": [["w", {"T": 0}], ["x", {"DT": {"T": 0, "layout": LAYOUT.to_json()}}]]},
     "tensor 0"),
    ({"dict": [["w", {"T": 0}], ["x", {"what": 1}]]}, "malformed"),
    ({"dict": [["w", {"T": 0}], ["x", 1.5]]}, "malformed"),
    (json.loads("[" * 150 + '{"T": 0}' + "]" * 150), "deeper"),
])
def test_a_structure_that_would_not_decode_is_corrupt_at_parse(hollow: Any, why: str) -> None:
    m = ShardManifest(session_id="s", iteration=1, owner_rank=0, world_size=1,
                      tensors=(TensorEntry("w", "float32", (4, 8), 0, 128, "cpu"),),
                      hollow=hollow, container="plain", data_nbytes=128, chunk_nbytes=128,
                      chunk_count=1, chunk_crc32c=(1,))
    doc = json.loads(json.dumps(m.to_json_dict()))
    with pytest.raises(CorruptShardError, match="shard-x") as info:
        ShardManifest.from_json_dict(doc, "shard-x")
    assert why in str(info.value)


@pytest.mark.parametrize("edit", [
    {"offset": [-4, 0]}, {"global_shape": [10**30, 8]}, {"global_stride": [-8, 1]},
    {"placements": ["SS(0,0)", "S(0)"]}, {"placements": ["S(\u0660)", "R"]},
    {"mesh_shape": [0, 2]},
])
def test_out_of_range_layout_values_are_corrupt(edit: dict[str, Any]) -> None:
    doc = json.loads(json.dumps(_manifest({**LAYOUT.to_json(), **edit}).to_json_dict()))
    with pytest.raises(CorruptShardError, match="shard-x"):
        ShardManifest.from_json_dict(doc, "shard-x")


def test_a_forged_structure_on_disk_is_quarantined_and_the_older_iteration_loaded(
        root: Path) -> None:
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        mgr.save({"w": torch.ones(3)}, 1)
        mgr.save({"w": torch.full((3,), 2.0)}, 2)
    meta = next((root / "s" / "iter_0000000002").glob("rank_*")) / "zarr.json"
    doc = json.loads(meta.read_text())
    body = doc["attributes"]["localckpt"]["manifest"]
    body["hollow"] = {"dict": [["w", {"f": 5}]]}  # checksummed, but no load could decode it
    doc["attributes"]["localckpt"]["crc32c"] = _crc_of(body)
    meta.write_text(json.dumps(doc))
    with LocalCheckpointManager(root, "s") as mgr:
        state, ckpt = mgr.load()
    assert ckpt[0] == 1 and torch.equal(state["w"], torch.ones(3))


def test_a_custom_tensor_aware_state_dict_with_a_bad_structure_is_refused_at_save(
        root: Path) -> None:
    class Custom(BasicTensorAwareStateDict):
        def hollow_structure(self) -> Any:
            return {"dict": [["w", {"T": 7}]]}

    with LocalCheckpointManager(root, "s") as mgr, pytest.raises(TypeError, match="tensor 7"):
        mgr.save(Custom({"w": torch.ones(2)}), 1)
    with LocalCheckpointManager(root, "s") as mgr:
        assert mgr.find_latest() == -1


def test_a_replica_stored_elsewhere_is_checked_like_a_shard() -> None:
    def parsed(replica: Any, nbytes: int = 0, shape: tuple[int, ...] = (0,)) -> ShardManifest:
        m = ShardManifest(
            session_id="s", iteration=3, owner_rank=2, world_size=4,
            tensors=(TensorEntry("model/w", "float32", shape, 0, nbytes, "cpu"),),
            hollow={"dict": [["w", {"DT": {"T": 0, "layout": LAYOUT.to_json(),
                                           "replica": replica}}]]},
            container="plain", data_nbytes=nbytes, chunk_nbytes=128, chunk_count=1,
            chunk_crc32c=(1,), created_unix=1.0)
        return ShardManifest.from_json_dict(json.loads(json.dumps(m.to_json_dict())), "shard-x")

    assert parsed([4, 8]).replicas == {0: (4, 8)}
    for bad, why in (([4], "replica shape"), ([14, 8], "does not fit"), ([4, -1], "replica")):
        with pytest.raises(CorruptShardError, match=why):
            parsed(bad)
    with pytest.raises(CorruptShardError, match="stored elsewhere"):
        parsed([4, 8], nbytes=128, shape=(4, 8))


def test_replicated_leaves_spread_over_their_group_and_a_missing_keeper_is_named() -> None:
    from localckpt.save.dedupe import keeper_index, missing_replicas

    keepers = [keeper_index(f"model/layers.{i}.norm.weight", 4) for i in range(64)]
    assert {k: keepers.count(k) for k in range(4)} == {k: keepers.count(k) for k in range(4)}
    assert min(keepers.count(k) for k in range(4)) >= 8  # no member left out
    assert missing_replicas([[1, 2], [3]], [{"1": [3]}, {"0": [1, 2]}]) == []
    assert missing_replicas([[1], [3]], [{}, {"0": [1, 2]}]) == [
        "rank 1 left 1 replicated shards to rank 0, which does not store them"]
