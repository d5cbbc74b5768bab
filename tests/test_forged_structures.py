"""Manifests whose checksum matches (a forger's, a foreign writer's) but whose structure no load
can decode: each must be a corrupt copy (quarantined, the older iteration loaded), never an
error on every rank that stops the job, nor data that loads changed."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from localckpt import LocalCheckpointManager
from localckpt.storage.manifest import _crc_of


def _items(body: dict[str, Any]) -> list[Any]:
    return body["hollow"]["dict"]


def _extended(body: dict[str, Any], item: list[Any]) -> None:
    _items(body).append(item)
    body["format_version"] = max(body["format_version"], 4)


FORGERIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "a float past the largest": lambda b: _items(b).append(["x", {"f": "0x1p99999"}]),
    "a complex part past the largest": lambda b: _items(b).append(
        ["x", {"c": ["0x1p0", "0x1p99999"]}]),
    "a numpy array of 65 dimensions": lambda b: _items(b).__setitem__(
        2, ["n", {"np": {"T": 2, "dtype": "<f4", "shape": [3] + [1] * 64}}]),
    "an empty numpy array too big to make": lambda b: _items(b).__setitem__(
        3, ["z", {"np": {"T": 3, "dtype": "<f4", "shape": [0, 2 ** 61, 2 ** 61]}}]),
    "an unhashable numpy scalar as a key": lambda b: _extended(b, ["x", {"dict": [[
        {"npg": {"dtype": "|V4", "b": base64.b64encode(bytes(4)).decode()}}, 1]]}]),
    "a tensor on the meta device": lambda b: b["tensors"][0].update(device="meta"),
}


@pytest.mark.parametrize("forge", list(FORGERIES.values()), ids=list(FORGERIES))
def test_a_forged_structure_is_a_corrupt_copy_and_the_older_iteration_loads(
        root: Path, forge: Callable[[dict[str, Any]], None]) -> None:
    def state(it: int) -> dict[str, Any]:
        return {"a": torch.full((3,), float(it)), "g": torch.Generator().manual_seed(it),
                "n": np.arange(3, dtype=np.float32), "z": torch.zeros(0)}

    with LocalCheckpointManager(root, "job", keep_last=2) as mgr:
        for it in (1, 2):
            mgr.save(state(it), it)
    meta = next((root / "job" / "iter_0000000002").glob("rank_*")) / "zarr.json"
    doc = json.loads(meta.read_text())
    body = doc["attributes"]["localckpt"]["manifest"]
    assert [e["key_path"] for e in body["tensors"]][:2] == ["a", "g"], body["tensors"]
    forge(body)
    doc["attributes"]["localckpt"]["crc32c"] = _crc_of(body)
    meta.write_text(json.dumps(doc))
    with LocalCheckpointManager(root, "job", keep_last=2) as mgr:
        loaded, ckpt = mgr.load()
    assert ckpt[0] == 1 and torch.equal(loaded["a"], torch.ones(3))
    assert loaded["a"].device.type == "cpu"


def test_a_namespace_attribute_of_any_name_round_trips(root: Path) -> None:
    """A Namespace's attributes are loaded as the items vars() gave: a dunder name (a version
    tag, or a forged __class__) is data, not a setattr that changes the object."""
    import argparse

    args = argparse.Namespace(lr=0.1)
    args.__version__ = "1.2"
    vars(args)["__class__"] = "not the class"
    with LocalCheckpointManager(root, "job") as mgr:
        mgr.save({"args": args, "t": torch.zeros(1)}, 1)
        loaded, _ = mgr.load()
    assert type(loaded["args"]) is argparse.Namespace and vars(loaded["args"]) == vars(args)


@pytest.mark.parametrize("device", ["npu:0", "hpu:1"])
def test_a_tensor_of_a_backend_this_process_lacks_loads_onto_the_cpu(root: Path,
                                                                     device: str) -> None:
    """A manifest naming a device whose backend a package registers (torch_npu's "npu"),
    read where that package is not imported: torch cannot parse the name, and the healthy
    copy was quarantined as corrupt (from the attacker review of this session's diff)."""
    with LocalCheckpointManager(root, "job") as mgr:
        mgr.save({"w": torch.arange(4.0)}, 1)
    meta = next((root / "job" / "iter_0000000001").glob("rank_*")) / "zarr.json"
    doc = json.loads(meta.read_text())
    body = doc["attributes"]["localckpt"]["manifest"]
    body["tensors"][0]["device"] = device  # as the save on that machine recorded it
    doc["attributes"]["localckpt"]["crc32c"] = _crc_of(body)
    meta.write_text(json.dumps(doc))
    with LocalCheckpointManager(root, "job") as mgr:
        loaded, ckpt = mgr.load()
    assert ckpt[0] == 1 and torch.equal(loaded["w"], torch.arange(4.0))
    assert loaded["w"].device.type == "cpu"
