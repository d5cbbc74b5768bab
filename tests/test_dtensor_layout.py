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

from localckpt import LocalCheckpointManager
from localckpt.dtensors import DTensorLayout, placement_from_str
from localckpt.errors import CorruptShardError
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
    assert m.format_version == FORMAT_VERSION == 2
    assert m.layouts == {0: LAYOUT}
    assert DTensorLayout.from_json(json.loads(json.dumps(LAYOUT.to_json()))) == LAYOUT


def test_placements_round_trip_including_strided_shards() -> None:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    assert placement_from_str("R") == Replicate()
    assert placement_from_str("S(1)") == Shard(1)
    assert placement_from_str("SS(0,2)") == _StridedShard(0, split_factor=2)
    with pytest.raises(ValueError, match="P"):
        placement_from_str("P(sum)")


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
