"""Leaves real state dicts carry: numpy arrays and scalars, RNG states, torch Generators,
dataclasses and named tuples (issue 20, item 3). Unit tests over the hollow encoding, then saves
and loads through a manager (a world of one)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import random
from collections import namedtuple
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from dist_harness import run_python

import localckpt
from localckpt import LocalCheckpointManager, UnsafeTypeError
from localckpt.state_dict import BasicTensorAwareStateDict, rebuild_state_dict
from localckpt.storage.manifest import FORMAT_VERSION, check_hollow
from localckpt.storage.store import ShardStore


@dataclasses.dataclass
class Schedule:
    warmup: int
    peak_lr: float
    betas: tuple[float, float] = (0.9, 0.95)
    history: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Frozen:
    step: int
    weights: torch.Tensor


class Position(NamedTuple):
    epoch: int
    sample: Any = None


Unregistered = namedtuple("Unregistered", "a b")


class Backend(enum.Enum):
    FLASH = "flash"
    LOCAL = 2


class Secret(enum.IntEnum):
    A = 1


localckpt.add_safe_types(Schedule, Frozen, Position, Backend)


def round_trip(state: Any, types: dict[str, type] | None = None) -> Any:
    """``state`` through the JSON hollow structure, the manifest's check, and a rebuild from
    copies of its tensors (what a load does, without the disk)."""
    tasd = BasicTensorAwareStateDict(state)
    hollow = json.loads(json.dumps(tasd.hollow_structure()))
    check_hollow(hollow, len(tasd.tensors), "test")
    tensors = [t.detach().clone() for t in tasd.tensors]
    return rebuild_state_dict(hollow, tensors, tasd.key_paths, ["cpu"] * len(tensors), True,
                              types=types)


ARRAYS = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "f16": np.linspace(-1, 1, 7).astype(np.float16),
    "i8": np.array([-128, 0, 127], dtype=np.int8),
    "u16": np.arange(5, dtype=np.uint16),
    "u64": np.array([2**64 - 1, 0], dtype=np.uint64),
    "bool": np.array([[True, False], [False, True]]),
    "c128": np.array([1 + 2j, np.nan + 1j]),
    "big_endian": np.arange(4, dtype=">i4"),
    "datetime": np.array(["2026-11-25T08:00", "NaT"], dtype="datetime64[ns]"),
    "timedelta": np.array([1, 2], dtype="timedelta64[s]"),
    "unicode": np.array(["ab", "cdé", ""]),
    "bytes": np.array([b"xy", b"\x00z"]),
    "record": np.array([(1.5, [1, 2]), (2.5, [3, 4])], dtype=[("x", "<f4"), ("y", "<i8", (2,))]),
    "scalar_array": np.array(3.25),
    "empty": np.zeros((0, 3), dtype=np.float64),
    "strided": np.arange(20)[::3],
    "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
}


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_numpy_arrays_round_trip_bit_exact(name: str) -> None:
    arr = ARRAYS[name]
    out = round_trip({"a": arr})["a"]
    assert type(out) is np.ndarray and out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == np.ascontiguousarray(arr).tobytes()


def test_numpy_arrays_are_stored_as_tensors_not_inline() -> None:
    arr = np.arange(1000, dtype=np.float32)
    tasd = BasicTensorAwareStateDict({"a": arr, "b": np.arange(3, dtype=">f8")})
    assert [t.dtype for t in tasd.tensors] == [torch.float32, torch.uint8]
    assert tasd.tensors[0].data_ptr() == arr.ctypes.data  # no copy until staging
    assert len(json.dumps(tasd.hollow_structure())) < 200


def test_numpy_scalars_keep_their_type() -> None:
    values = {"f64": np.float64(0.1), "f32": np.float32(1.5), "i64": np.int64(-3),
              "u8": np.uint8(255), "b": np.bool_(True), "s": np.str_("hé"),
              "dt": np.datetime64("2026-01-01", "D"), "c": np.complex64(1 - 1j)}
    out = round_trip(values)
    for key, value in values.items():
        assert type(out[key]) is type(value) and out[key] == value, key


def test_object_arrays_are_refused_naming_the_key_path() -> None:
    with pytest.raises(TypeError, match=r"'loader/buffer'.*holds Python objects"):
        BasicTensorAwareStateDict({"loader": {"buffer": np.array([{"a": 1}], dtype=object)}})


def test_unsupported_leaf_error_lists_the_supported_types() -> None:
    with pytest.raises(TypeError, match=r"'x'.*numpy array.*dataclass.*got builtins.set"):
        BasicTensorAwareStateDict({"x": {1, 2}})


def test_rng_states_restore_the_same_streams() -> None:
    np.random.seed(7)
    random.seed(7)
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    for draw in (np.random.rand, random.random, rng.random, lambda: torch.rand(1, generator=gen)):
        draw()  # not at the seed's start
    state = {"numpy": np.random.get_state(), "python": random.getstate(),
             "bit_generator": rng.bit_generator.state, "torch": torch.get_rng_state(),
             "generator": gen}
    out = round_trip(state)
    expected = (np.random.rand(3), [random.random() for _ in range(3)], rng.random(3),
                torch.rand(3, generator=gen))
    np.random.set_state(out["numpy"])
    random.setstate(out["python"])
    rng2 = np.random.default_rng()
    rng2.bit_generator.state = out["bit_generator"]
    assert isinstance(out["generator"], torch.Generator)
    got = (np.random.rand(3), [random.random() for _ in range(3)], rng2.random(3),
           torch.rand(3, generator=out["generator"]))
    assert np.array_equal(got[0], expected[0]) and got[1] == expected[1]
    assert np.array_equal(got[2], expected[2]) and torch.equal(got[3], expected[3])
    assert torch.equal(out["torch"], state["torch"])


def test_dataclasses_and_named_tuples_round_trip() -> None:
    state = {"schedule": Schedule(100, 3e-4, history=[Position(1, np.int32(5))]),
             "frozen": Frozen(3, torch.arange(4)), "pos": Position(2)}
    out = round_trip(state)
    assert out["schedule"] == state["schedule"]
    assert type(out["schedule"].history[0]) is Position
    assert type(out["schedule"].betas) is tuple
    assert out["frozen"].step == 3 and torch.equal(out["frozen"].weights, torch.arange(4))
    assert out["pos"] == Position(2, None)


def test_a_type_that_is_not_allowed_is_refused_and_nothing_is_imported() -> None:
    state = {"u": Unregistered(1, 2)}
    with pytest.raises(UnsafeTypeError, match=r"Unregistered.*add_safe_types"):
        round_trip(state)
    assert round_trip(state, types={"test_leaves:Unregistered": Unregistered})["u"] == (1, 2)
    for name in ("os:system", "builtins:dict", "subprocess:Popen", "localckpt.manager:Path"):
        evil = {"nt": {"type": name, "fields": [["a", "rm -rf /"]]}}
        with pytest.raises(UnsafeTypeError):
            rebuild_state_dict(evil, [], [], [], True)


def test_class_changes_since_the_save() -> None:
    @dataclasses.dataclass
    class Cfg:
        lr: float

    name = f"{Cfg.__module__}:{Cfg.__qualname__}"
    saved = {"dc": {"type": name, "fields": [["lr", {"f": (0.5).hex()}]]}}

    @dataclasses.dataclass
    class Grown:  # a field added with a default: the saved object gets it
        lr: float
        decay: float = 0.1

    assert rebuild_state_dict(saved, [], [], [], True, types={name: Grown}) == Grown(0.5, 0.1)

    @dataclasses.dataclass
    class Required:
        lr: float
        decay: float

    with pytest.raises(ValueError, match=r"lacks fields \['decay'\]"):
        rebuild_state_dict(saved, [], [], [], True, types={name: Required})

    @dataclasses.dataclass
    class Shrunk:
        rate: float = 0.0

    with pytest.raises(ValueError, match=r"fields \['lr'\] its class no longer has"):
        rebuild_state_dict(saved, [], [], [], True, types={name: Shrunk})


def test_megatron_args_leaves_round_trip() -> None:
    """What Megatron's ``args`` and ShardedTensors hold: a Namespace, dtypes, enums, slices."""
    args = argparse.Namespace(params_dtype=torch.bfloat16, backend=Backend.LOCAL, lr=3e-4,
                              layers=[1, 2], flat=slice(4, 20, None), name="gpt")
    out = round_trip({"args": args, "dtypes": [torch.float8_e4m3fn, torch.int64, torch.bool]})
    assert out["args"] == args and out["args"].backend is Backend.LOCAL
    assert out["dtypes"] == [torch.float8_e4m3fn, torch.int64, torch.bool]
    with pytest.raises(UnsafeTypeError, match="Secret"):
        round_trip({"s": Secret.A})
    assert round_trip({"s": Secret.A}, types={"test_leaves:Secret": Secret})["s"] is Secret.A


def test_a_hollow_tensor_aware_state_dict_is_refused() -> None:
    @dataclasses.dataclass
    class Hollow:
        common: dict[str, Any]
        is_hollow: bool = True

    with pytest.raises(TypeError, match="hollow"):
        BasicTensorAwareStateDict({"x": Hollow({})})


def test_add_safe_types_refuses_other_types() -> None:
    with pytest.raises(TypeError, match="dataclass, named tuple or enum"):
        localckpt.add_safe_types(dict)


@pytest.mark.parametrize("node", [
    {"np": {"T": 0, "dtype": "|O", "shape": [1]}},
    {"np": {"T": 0, "dtype": "<f4", "shape": [-1]}},
    {"np": {"T": 1, "dtype": "<f4", "shape": [1]}},
    {"npg": {"dtype": "<f8", "b": "!!"}},
    {"npg": {"dtype": "<f8", "b": "AAAA"}},
    {"G": {"T": 0, "device": "not a device"}},
    {"dc": {"type": 3, "fields": []}},
    {"nt": {"type": "a:b", "fields": [["x"]]}},
    {"dtype": "nn"},
    {"dtype": "__class__"},
    {"slice": [1, 2]},
    {"ns": [[1, 2]]},
    {"enum": {"type": "a:B"}},
])
def test_malformed_extended_nodes_fail_the_manifest_check(node: Any) -> None:
    with pytest.raises(localckpt.CorruptShardError, match="malformed structure"):
        check_hollow(node, 1, "test")


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"weights": torch.randn(64, 64, generator=gen),
            "ema": np.full((128,), step, dtype=np.float64),
            "numpy_rng": np.random.RandomState(step).get_state(),
            "sampler": gen, "schedule": Schedule(step, 1e-3),
            "seen": np.array([b"shard-%d" % step]), "best": np.float32(step / 2)}


def test_manager_saves_and_loads_them(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(_state(3), 3)
        store: ShardStore = mgr._ctx.store
        assert store.read_manifest(store.ref(3, 0, 1)).format_version == FORMAT_VERSION == 4
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load()
    want = _state(3)
    assert torch.equal(loaded["weights"], want["weights"])
    assert np.array_equal(loaded["ema"], want["ema"]) and loaded["ema"].dtype == np.float64
    assert loaded["numpy_rng"][0] == "MT19937"
    assert np.array_equal(loaded["numpy_rng"][1], want["numpy_rng"][1])
    assert torch.equal(torch.rand(4, generator=loaded["sampler"]),
                       torch.rand(4, generator=want["sampler"]))
    assert loaded["schedule"] == want["schedule"] and loaded["seen"][0] == b"shard-3"
    assert type(loaded["best"]) is np.float32 and loaded["best"] == 1.5


def test_plain_state_dicts_keep_the_oldest_format(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"w": torch.ones(3), "step": 1}, 1)
        store: ShardStore = mgr._ctx.store
        assert store.read_manifest(store.ref(1, 0, 1)).format_version == 1


def test_load_into_restores_in_place(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({**_state(5), "u": Unregistered(1, np.arange(3))}, 5)
    target = {**_state(0), "u": Unregistered(0, np.zeros(3, dtype=np.int64))}
    ema, sampler = target["ema"], target["sampler"]
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load(into=target)
    assert loaded["sampler"] is sampler  # the caller's generator, its state set
    assert torch.equal(torch.rand(4, generator=sampler),
                       torch.rand(4, generator=_state(5)["sampler"]))
    assert np.all(ema == 5)  # read into the caller's array
    assert type(loaded["u"]) is Unregistered and list(loaded["u"].b) == [0, 1, 2]


def test_load_into_a_generator_where_the_checkpoint_has_no_generator(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"sampler": {"seed": 3}}, 1)
    with LocalCheckpointManager(root, "s") as mgr, \
            pytest.raises(localckpt.ConfigurationError, match=r"'sampler' is a torch\.Generator"):
        mgr.load(into={"sampler": torch.Generator()})


def test_unallowed_type_fails_the_load_with_a_clear_error(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"u": Unregistered(1, 2)}, 1)
    with LocalCheckpointManager(root, "s") as mgr, pytest.raises(UnsafeTypeError,
                                                                 match="Unregistered"):
        mgr.load()


# ------------------------------------------------------------------ attacker review findings

def _save_load(root: Path, saved: dict[str, Any], into: Any = None) -> Any:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save(saved, 1)
    with LocalCheckpointManager(root, "s") as mgr:
        return mgr.load(into=into)[0]


@pytest.mark.parametrize("value", [np.ma.masked_invalid(np.array([0.5, np.nan])),
                                   np.matrix([[1, 2], [3, 4]]),
                                   np.rec.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")])],
                         ids=["masked", "matrix", "recarray"])
def test_numpy_subclasses_are_refused_not_flattened(value: Any) -> None:
    with pytest.raises(TypeError, match=r"'stats'.*numpy array subclass"):
        BasicTensorAwareStateDict({"stats": value})


@pytest.mark.parametrize("saved,target", [
    (np.array(["2020-01-01"], "M8[ns]"), np.array(["1999-01-01"], "M8[s]")),
    (np.array([(1, 2)], dtype=[("a", "<i4"), ("b", "<i4")]),
     np.array([(0, 0)], dtype=[("b", "<i4"), ("a", "<i4")])),
    (np.array(["abcd"]), np.zeros(16, np.uint8)),
    (np.array([["a", "b", "c"], ["d", "e", "f"]]), np.full((3, 2), "z")),
    (np.arange(6.0).reshape(2, 3), np.zeros((2, 3), order="F")),
], ids=["datetime-unit", "field-order", "U4-into-uint8", "shape", "fortran"])
def test_into_arrays_of_another_dtype_or_layout_are_left_alone(root: Path, saved: Any,
                                                               target: Any) -> None:
    before = target.copy()
    out = _save_load(root, {"a": saved}, into={"a": target})
    assert out["a"].dtype == saved.dtype and out["a"].tobytes() == saved.tobytes()
    assert np.array_equal(target, before)


@pytest.mark.parametrize("dtype", ["V0", [("a", "<i4", (0,))], []],
                         ids=["V0", "empty-subarray-field", "no-fields"])
def test_zero_itemsize_arrays_load(root: Path, dtype: Any) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"w": torch.ones(2)}, 1)
        mgr.save({"w": torch.ones(2), "tags": np.zeros(3, dtype=dtype)}, 2)  # 1 is deleted
    with LocalCheckpointManager(root, "s") as mgr:
        state, (iteration, _, _) = mgr.load()
    assert iteration == 2 and state["tags"].shape == (3,) and state["tags"].dtype == dtype


@dataclasses.dataclass
class _D:
    x: int


_P = namedtuple("_P", "x")
localckpt.add_safe_types(_D, _P)
_DEEP: Any = "<f4"
for _ in range(400):
    _DEEP = [["a", _DEEP]]


@pytest.mark.parametrize("node", [
    {"np": {"T": 0, "dtype": "<f8", "shape": [4]}},  # 32 bytes said, 16 stored
    {"np": {"T": 0, "dtype": _DEEP, "shape": [1]}},
    {"G": {"T": 0, "device": "cpu"}},  # a float32 tensor as a generator's state
    {"G": {"T": 0, "device": "meta"}},
])
def test_crafted_manifests_fail_the_check_not_the_decoding(root: Path, node: Any) -> None:
    """A shard whose manifest (CRC recomputed: a CRC is no signature) would fail decoding is
    corrupt: it is quarantined and the load falls back, rather than every rank raising."""
    from localckpt.storage.manifest import ShardManifest, _crc_of

    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"a": torch.zeros(4)}, 1)
        mgr.save({"a": torch.arange(4, dtype=torch.float32)}, 2)
    path = next(root.glob("s/iter_0000000002/rank_*/zarr.json"))
    doc = json.loads(path.read_text())
    body = doc["attributes"]["localckpt"]["manifest"]
    body["hollow"], body["format_version"] = {"dict": [["a", node]]}, 4
    doc["attributes"]["localckpt"]["crc32c"] = _crc_of(body)
    path.write_text(json.dumps(doc))
    with pytest.raises(localckpt.CorruptShardError, match="inconsistent manifest"):
        ShardManifest.from_json_dict(doc["attributes"]["localckpt"], "crafted")


def test_check_hollow_refuses_new_nodes_in_old_formats_and_unhashable_keys() -> None:
    with pytest.raises(localckpt.CorruptShardError, match="format 3"):
        check_hollow({"npg": {"dtype": "<f8", "b": "AAAAAAAA8D8="}}, 0, "x", version=3)
    with pytest.raises(localckpt.CorruptShardError, match="dict key"):
        check_hollow({"dict": [[{"np": {"T": 0, "dtype": "<f4", "shape": [1]}}, 1]]}, 1, "x")
    check_hollow({"dict": [[{"npg": {"dtype": "<i8", "b": "AwAAAAAAAAA="}}, 1]]}, 0, "x")


def test_numpy_scalar_keys_round_trip() -> None:
    out = round_trip({"counts": {np.int64(3): 1, (np.str_("a"), 2): 5}})
    assert out["counts"] == {np.int64(3): 1, ("a", 2): 5}
    assert type(next(iter(out["counts"]))) is np.int64


def test_dtype_and_enum_keys_round_trip() -> None:
    """Megatron's distributed optimizer keys its per-bucket state by (param dtype, grad dtype)
    tuples; such keys were refused at save though a load reads them."""
    state = {"param_state": {0: {(torch.bfloat16, torch.float32): [torch.ones(3)]}},
             "by_dtype": {torch.float16: 1, Backend.FLASH: "f", (Backend.LOCAL, 2): 3}}
    out = round_trip(state)
    assert list(out["param_state"][0]) == [(torch.bfloat16, torch.float32)]
    assert torch.equal(out["param_state"][0][torch.bfloat16, torch.float32][0], torch.ones(3))
    assert out["by_dtype"] == {torch.float16: 1, Backend.FLASH: "f", (Backend.LOCAL, 2): 3}
    assert type(list(out["by_dtype"])[1]) is Backend
    with pytest.raises(UnsafeTypeError, match="Secret"):  # saved; a load names what it refuses
        round_trip({"k": {Secret.A: 1}})


def test_a_key_of_another_type_is_named() -> None:
    with pytest.raises(TypeError, match=r"key at 'k'.*torch.dtype, enum member.*got builtins"
                       r".object \(in the tuple key \(1, <object"):
        round_trip({"k": {(1, object()): 1}})


def test_torch_size_values_load_back_as_equal_tuples() -> None:
    """Megatron's ShardedTensor.narrow keeps ``new_data.shape`` (a torch.Size) as local_shape."""
    out = round_trip({"local_shape": torch.Size([2, 3]), "nested": [torch.Size([])],
                      "keyed": {torch.Size([4]): 1}})
    assert out["local_shape"] == torch.Size([2, 3]) and type(out["local_shape"]) is tuple
    assert out["nested"] == [()] and out["keyed"] == {(4,): 1}


def test_a_named_tuple_that_became_a_dataclass_is_a_clear_error() -> None:
    saved = {"nt": {"type": "test_leaves:_D", "fields": [["x", 1]]}}
    with pytest.raises(ValueError, match="saved as a named tuple"):
        rebuild_state_dict(saved, [], [], [], True)


def test_a_class_defined_again_replaces_the_registered_one() -> None:
    first = dataclasses.make_dataclass("Again", [("lr", float)])
    second = dataclasses.make_dataclass("Again", [("lr", float)])
    localckpt.add_safe_types(first)
    localckpt.add_safe_types(second)
    saved = {"dc": {"type": f"{second.__module__}:Again", "fields": [["lr", 1]]}}
    assert type(rebuild_state_dict(saved, [], [], [], True)) is second


def test_cycles_and_dict_dataclasses_are_refused_naming_the_key_path() -> None:
    @dataclasses.dataclass
    class Node:
        parent: Any = None

    node = Node()
    node.parent = node
    with pytest.raises(TypeError, match=r"'tree/parent'.*holds itself"):
        BasicTensorAwareStateDict({"tree": node})

    @dataclasses.dataclass
    class Bag(dict):  # type: ignore[type-arg]
        tag: str = "x"

    with pytest.raises(TypeError, match=r"'bag'.*also a dict"):
        BasicTensorAwareStateDict({"bag": Bag()})


def test_an_unstorable_record_dtype_names_the_key_path() -> None:
    value = np.zeros(2, dtype={"names": ["a", "b"], "formats": ["<i4", "<i4"], "offsets": [4, 0]})
    with pytest.raises(TypeError, match="'model/buf'"):
        BasicTensorAwareStateDict({"model": {"buf": value}})


def test_a_generator_with_nothing_saved_is_named_as_one(root: Path) -> None:
    with pytest.raises(localckpt.ConfigurationError, match=r"torch\.Generators at \['g'\]"):
        _save_load(root, {"g": None}, into={"g": torch.Generator()})


class _Perm(enum.Flag):
    R = 1
    W = 2


def _deep(levels: int) -> Any:
    node: Any = 0
    for _ in range(levels):
        node = [node]
    return node


@pytest.mark.parametrize("value, says", [
    (_deep(120), "nest"),  # deeper than a load accepts
    (argparse.Namespace(**{"1": 2}), "Namespace"),  # non-identifier attribute names are fine...
])
def test_a_save_no_load_could_decode_is_refused_at_save(root: Path, value: Any,
                                                         says: str) -> None:
    """Everything save accepts must load: a structure the load's check refuses was saved, then
    its healthy copy quarantined as corrupt by every load (the job fell back or found nothing)."""
    if isinstance(value, argparse.Namespace):
        value.__dict__[1] = 2  # ...an int attribute name is not
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        mgr.save({"w": torch.ones(2), "x": 1}, 1)
        with pytest.raises(Exception, match=says) as info:
            mgr.save({"w": torch.ones(2), "x": value}, 2)
        assert "TypeError" in type(info.value).__name__ or isinstance(info.value, TypeError)
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        loaded, (it, _, _) = mgr.load()
    assert it == 1 and loaded["x"] == 1
    assert not list(root.rglob(".quarantine*"))


def test_a_zero_size_numpy_scalar_round_trips(root: Path) -> None:
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"v": np.void(b"")}, 1)
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, _ = mgr.load()
    assert isinstance(loaded["v"], np.void) and loaded["v"].dtype.itemsize == 0


def test_a_combined_flag_is_refused_at_save_not_unloadable(root: Path) -> None:
    localckpt.add_safe_types(_Perm)
    with LocalCheckpointManager(root, "s") as mgr:
        mgr.save({"p": _Perm.R}, 1)  # a member: saved and loaded
        with pytest.raises(Exception, match="Flag"):
            mgr.save({"p": _Perm.R | _Perm.W}, 2)
    with LocalCheckpointManager(root, "s") as mgr:
        loaded, (it, _, _) = mgr.load()
    assert it == 1 and loaded["p"] is _Perm.R


def test_a_dtype_node_is_looked_up_not_imported() -> None:
    """A manifest's {"dtype": "_dynamo"} made a load import torch._dynamo (821 modules)."""
    from localckpt import leaves

    assert leaves.dtype_by_name("bfloat16") is torch.bfloat16
    for bad in ("nn", "compile", "Tensor", 3):
        with pytest.raises(ValueError, match="not a torch dtype"):
            leaves.dtype_by_name(bad)
    code = ("import sys\nfrom localckpt import leaves\n"
            "try:\n    leaves.dtype_by_name('_dynamo')\nexcept ValueError:\n    pass\n"
            "print('torch._dynamo' in sys.modules)\n")
    proc = run_python(code)
    assert proc.stdout.strip() == "False", (proc.stdout, proc.stderr[-1000:])


@dataclasses.dataclass
class _Scaled:
    lr: float

    def __post_init__(self) -> None:
        self.scaled_lr = self.lr * 8  # an attribute that is no field


@dataclasses.dataclass
class _Cached:
    lr: float

    @functools.cached_property
    def scaled_lr(self) -> float:
        return self.lr * 8


def test_a_dataclass_attribute_that_is_no_field_is_refused_not_dropped() -> None:
    """A load builds a dataclass from its fields without running __init__: an attribute set
    in __post_init__ was dropped at save and the loaded object raised AttributeError on use. A
    cached_property's value (computed again on use) is no loss."""
    with pytest.raises(TypeError, match=r"'cfg'.*not fields \('scaled_lr'\)"):
        BasicTensorAwareStateDict({"cfg": _Scaled(0.1)})
    cached = _Cached(0.1)
    assert cached.scaled_lr == 0.8
    tasd = BasicTensorAwareStateDict({"cfg": cached})
    back = rebuild_state_dict(tasd.hollow_structure(), [], [], [], True,
                              types={"test_leaves:_Cached": _Cached})
    assert back["cfg"] == cached and back["cfg"].scaled_lr == 0.8
