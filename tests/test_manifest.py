"""Manifest JSON: round trip, version and checksum checks (no processes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from localckpt.errors import CorruptShardError, UnsupportedFormatError
from localckpt.storage.manifest import (
    FORMAT_VERSION,
    MAX_HOLLOW_DEPTH,
    READABLE_VERSIONS,
    ShardManifest,
    TensorEntry,
    check_hollow,
)


def _manifest() -> ShardManifest:
    return ShardManifest(
        session_id="s", iteration=12, owner_rank=3, world_size=8,
        tensors=(TensorEntry("model/w", "bfloat16", (4, 2), 0, 16, "cuda:1"),
                 TensorEntry("step", "int64", (), 64, 8, "cpu")),
        hollow={"dict": [["model", {"dict": [["w", {"T": 0}]]}], ["step", {"T": 1}]]},
        container="plain", data_nbytes=72, chunk_nbytes=72, chunk_count=1,
        chunk_crc32c=(123456789,), created_unix=1700000000.25, identity={"hostname": "n1"},
    )


def test_json_round_trip_is_exact() -> None:
    m = _manifest()
    text = json.dumps(m.to_json_dict())
    back = ShardManifest.from_json_dict(json.loads(text), "where")
    assert back == m and back.ckpt_id == (12, 3, "s")


def test_unknown_format_version_is_rejected_with_both_versions() -> None:
    from localckpt.storage.manifest import _crc_of

    doc = _manifest().to_json_dict()
    newer = max(READABLE_VERSIONS) + 1
    doc["manifest"]["format_version"] = newer
    doc["crc32c"] = _crc_of(doc["manifest"])  # intact, written by another version
    with pytest.raises(UnsupportedFormatError) as info:
        ShardManifest.from_json_dict(doc, "shard-x")
    assert "shard-x" in str(info.value) and str(newer) in str(info.value)


def test_edited_manifest_fails_its_checksum() -> None:
    doc = _manifest().to_json_dict()
    doc["manifest"]["tensors"][0]["key_path"] = "model/v"
    with pytest.raises(CorruptShardError, match="manifest checksum mismatch"):
        ShardManifest.from_json_dict(doc, "shard-x")


@pytest.mark.parametrize("doc", [None, [], {"manifest": 3, "crc32c": 1}, {"crc32c": 1}])
def test_malformed_documents_are_corrupt_not_crashes(doc: object) -> None:
    with pytest.raises(CorruptShardError):
        ShardManifest.from_json_dict(doc, "shard-x")


def test_received_bytes_are_reused_verbatim_and_checked() -> None:
    m = _manifest()
    back = ShardManifest.from_json_bytes(m.encoded, "from rank 1")
    assert back == m and back.encoded == m.encoded
    assert json.loads(m.encoded) == m.to_json_dict()
    with pytest.raises(CorruptShardError, match="from rank 1: unreadable manifest"):
        ShardManifest.from_json_bytes(m.encoded[:-3], "from rank 1")
    with pytest.raises(CorruptShardError, match="manifest checksum mismatch"):
        ShardManifest.from_json_bytes(m.encoded.replace(b"model/w", b"model/v"), "from rank 1")


def _edited(edit: object) -> dict:  # type: ignore[type-arg]
    from localckpt.storage.manifest import _crc_of

    doc = _manifest().to_json_dict()
    edit(doc["manifest"])  # type: ignore[operator]
    doc["crc32c"] = _crc_of(doc["manifest"])  # consistent: only the entries are wrong
    return doc


def _set(index: int, **fields: object):  # type: ignore[no-untyped-def]
    return lambda body: body["tensors"][index].update(fields)


@pytest.mark.parametrize("edit,text", [
    (_set(0, nbytes=17), "nbytes"),
    (_set(0, shape=[-4, 2]), "shape"),
    (_set(0, shape=[1 << 40, 1 << 40]), "nbytes"),
    (_set(1, offset=70), "beyond"),
    (_set(1, offset=-8), "offset"),
    (_set(1, offset=8), "overlap"),
    (lambda body: body.update(data_nbytes=200), "chunk"),
    (lambda body: body.update(chunk_crc32c=[]), "checksums"),
    (lambda body: body.update(hollow={"dict": [["w", {"T": 7}]]}), "tensor 7"),
    (lambda body: body.update(owner_rank=8), "owner"),
    (lambda body: body.update(iteration=-1), "iteration"),
])
def test_inconsistent_entries_are_corrupt_before_anything_is_allocated(edit: object,
                                                                       text: str) -> None:
    with pytest.raises(CorruptShardError, match=text) as info:
        ShardManifest.from_json_dict(_edited(edit), "shard-x")
    assert "shard-x" in str(info.value)


def test_an_unknown_dtype_is_an_unsupported_format() -> None:
    with pytest.raises(UnsupportedFormatError, match="float3_e1m1"):
        ShardManifest.from_json_dict(_edited(_set(0, dtype="float3_e1m1")), "shard-x")


def test_a_damaged_version_or_number_is_corruption_not_another_format() -> None:
    doc = _manifest().to_json_dict()
    doc["manifest"]["format_version"] = FORMAT_VERSION + 2  # a flipped digit: checksum fails
    with pytest.raises(CorruptShardError, match="checksum mismatch"):
        ShardManifest.from_json_dict(doc, "shard-x")
    doc = _manifest().to_json_dict()
    doc["manifest"]["created_unix"] = float("inf")  # "1.7e9" damaged into "1.7e999"
    with pytest.raises(CorruptShardError, match="shard-x"):
        ShardManifest.from_json_dict(doc, "shard-x")


@pytest.mark.parametrize("device", ["cuda:-1", "Cuda:0", "cuda 0", "cuda:0:1", "", "meta",
                                    "x" * 40, "cpu:\u0663", "cuda:01", "cuda:1000"])
def test_a_string_no_device_is_named_by_is_inconsistent(device: str) -> None:
    with pytest.raises(CorruptShardError, match="names device"):
        ShardManifest.from_json_dict(_edited(_set(0, device=device)), "shard-x")


def test_a_device_of_a_backend_this_process_lacks_is_consistent() -> None:
    """Loaded onto the CPU, with a warning: a package's backend ("npu") is no device torch
    can even parse where that package is not imported."""
    ShardManifest.from_json_dict(_edited(_set(0, device="npu:0")), "shard-x")


@pytest.mark.parametrize("hollow, error", [
    # a tensor leaf one level too deep, as a dict item (the checker's inline case) and in a list
    ({"dict": [["k", {"T": 0}]]}, "nests deeper"),
    ([{"T": 0}], "nests deeper"),
    # a dict item naming a tensor out of range, or one already a DTensor's shard
    (None, "refers to tensor 5 of 1"),
    ("dt-then-plain", "refers to tensor 0"),
])
def test_hollow_check_refuses_what_decoding_could_not_rebuild(hollow: object, error: str) -> None:
    if hollow is None:
        hollow = {"dict": [["w", {"T": 5}]]}
    elif hollow == "dt-then-plain":
        layout = {"global_shape": [4], "global_stride": [1], "mesh_shape": [2],
                  "mesh_dim_names": None, "placements": ["S(0)"], "coordinate": [0],
                  "offset": [0]}
        hollow = {"tuple": [{"dict": [["w", {"T": 0}]]}, {"DT": {"T": 0, "layout": layout}}]}
    else:
        for _ in range(MAX_HOLLOW_DEPTH):
            hollow = [hollow]
    with pytest.raises(CorruptShardError, match=error):
        check_hollow(hollow, 1, "m")


def test_the_manifest_is_written_canonical_and_verified_without_encoding_it_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``encoded`` is the manifest in the form its checksum is taken over, so a reader checks the
    bytes as they are; a nested "crc32c" key inside the manifest does not confuse where the
    envelope's own checksum starts."""
    from localckpt.storage import manifest as mod

    m = dataclasses.replace(_manifest(), metadata={"custom": {"crc32c": 7, "k": ',"crc32c":1}'}})
    body = m.to_json_dict()["manifest"]
    assert m.encoded == b'{"manifest":' + mod._canonical(body) + \
        b',"crc32c":' + str(mod._crc_of(body)).encode() + b"}"

    def never(body: object) -> bytes:
        raise AssertionError("encoded again")

    monkeypatch.setattr(mod, "_canonical", never)
    back = ShardManifest.from_json_bytes(m.encoded, "peer")
    assert back == m and back.encoded == m.encoded


def test_an_earlier_writers_spaced_manifest_is_still_read() -> None:
    """Before the canonical layout the envelope was spaced and its checksum taken over a
    re-encoding: such bytes, received or in a file, are verified that way."""
    from localckpt.storage.manifest import GROUP_PREFIX, GROUP_SUFFIX
    from localckpt.storage.shard_reader import parse_manifest_file

    m = _manifest()
    spaced = json.dumps(m.to_json_dict()).encode()
    assert spaced != m.encoded
    assert ShardManifest.from_json_bytes(spaced, "peer") == m
    read = parse_manifest_file(GROUP_PREFIX + spaced + GROUP_SUFFIX, "zarr.json")
    assert read == m and read.encoded == spaced
    with pytest.raises(CorruptShardError, match="manifest checksum mismatch"):
        ShardManifest.from_json_bytes(spaced.replace(b"model/w", b"model/v"), "peer")


def _enveloped(span: bytes, digits: bytes | None = None) -> bytes:
    from localckpt.storage.checksum import crc32c

    return b'{"manifest":' + span + b',"crc32c":' + (digits or str(crc32c(span)).encode()) + b"}"


def _body_with(**edits: object) -> bytes:
    from localckpt.storage.manifest import _canonical

    body = _manifest().to_json_dict()["manifest"]
    text = _canonical(body)
    for key, raw in edits.items():  # a number as a forger writes it, not as json.dumps would
        value = json.dumps(body[key], separators=(",", ":")).encode()
        text = text.replace(b'"%s":%s' % (key.encode(), value), b'"%s":%s' % (key.encode(),
                                                                              str(raw).encode()))
        assert str(raw).encode() in text
    return text


@pytest.mark.parametrize("span", [
    b'{"created_unix":NaN}', b'{"x":Infinity}', b"[1,2]", b'{"a":',
    _body_with(created_unix="1e400"), _body_with(iteration="1e400"),
    _body_with(created_unix=10**400), "\ufeff".encode() + _body_with(),
    _body_with().decode().encode("utf-16-le"), b" " + _body_with() + b" "])
def test_a_span_with_a_matching_checksum_must_still_be_a_plain_manifest(span: bytes) -> None:
    """Bytes whose checksum matches them as they are (a forger's, a foreign writer's) are still
    refused unless they are one UTF-8 JSON object of finite numbers, which every reader and
    zarr can parse again: a CorruptShardError, as when they are encoded again to be checked,
    never another exception (an OverflowError would stop a restore instead of quarantining)."""
    with pytest.raises(CorruptShardError, match="peer"):
        ShardManifest.from_json_bytes(_enveloped(span), "peer")


def test_the_envelopes_checksum_must_be_written_as_json_writes_it() -> None:
    """A checksum with a leading zero is no JSON number: the bytes are not sent on as they are."""
    from localckpt.storage.checksum import crc32c

    span = _body_with()
    digits = b"0" + str(crc32c(span)).encode()
    with pytest.raises(CorruptShardError, match="peer: unreadable manifest"):
        ShardManifest.from_json_bytes(_enveloped(span, digits), "peer")


def test_a_huge_number_in_a_spaced_manifest_is_corruption() -> None:
    """The old path too: an integer too large for a float is corrupt, not an OverflowError."""
    from localckpt.storage.manifest import _crc_of

    body = _manifest().to_json_dict()["manifest"]
    body["created_unix"] = 10**400
    with pytest.raises(CorruptShardError, match="shard-x"):
        ShardManifest.from_json_dict({"manifest": body, "crc32c": _crc_of(body)}, "shard-x")


@pytest.mark.parametrize("item", [
    {"key_path": "a/b", "dtype": "float32", "shape": [2, 3], "offset": 64, "nbytes": 24,
     "device": "cuda:0"},
    {"key_path": 5, "dtype": "float32", "shape": [2.0, True], "offset": True, "nbytes": 8.0,
     "device": "cpu"},  # types a writer never produces: converted as str and int take them
    {"key_path": "a", "dtype": "int8", "shape": [], "offset": "64", "nbytes": 1, "device": "cpu"},
    {"key_path": "a", "dtype": "int8", "shape": [1], "offset": 0, "nbytes": 1},  # no device
    {"key_path": "a", "dtype": "int8", "shape": 3, "offset": 0, "nbytes": 1, "device": "cpu"},
    {"key_path": "a", "dtype": "int8", "shape": [1], "offset": "x", "nbytes": 1, "device": "cpu"},
    ["key_path", "dtype"],  # not an object
])
def test_entries_are_read_as_str_and_int_take_them(item: object) -> None:
    from localckpt.storage.tensor_table import TensorEntry, entries_from_rows

    def as_before(t: dict) -> TensorEntry:  # type: ignore[type-arg]
        return TensorEntry(str(t["key_path"]), str(t["dtype"]), tuple(map(int, t["shape"])),
                           int(t["offset"]), int(t["nbytes"]), str(t["device"]))

    try:
        expected: object = (as_before(item),)
    except (KeyError, TypeError, ValueError) as exc:
        with pytest.raises(type(exc)):
            entries_from_rows([item])
        return
    got = entries_from_rows([item])
    assert got == expected and type(got[0]) is TensorEntry
    assert [type(v) for v in got[0]] == [type(v) for v in expected[0]]  # type: ignore[index]


def _columns_manifest() -> ShardManifest:
    """Version 6: the same tensors, their table in columns."""
    return dataclasses.replace(_manifest(), format_version=6)


def test_a_table_in_columns_round_trips_exactly() -> None:
    m = _columns_manifest()
    body = m.to_json_dict()["manifest"]
    assert "tensors" not in body and list(body["tensor_table"]["key_path"]) == ["model/w", "step"]
    back = ShardManifest.from_json_dict(json.loads(json.dumps(m.to_json_dict())), "where")
    assert back == m
    # kept in memory (columns as tuples, as a parity block's members once were): the same
    assert ShardManifest.from_json_dict(m.to_json_dict(), "where") == m
    assert ShardManifest.from_json_bytes(m.encoded, "where") == m  # the canonical envelope
    empty = dataclasses.replace(m, tensors=(), hollow={"dict": []}, data_nbytes=0)
    assert ShardManifest.from_json_bytes(empty.encoded, "where") == empty


def _columns_edited(edit: object) -> dict:  # type: ignore[type-arg]
    from localckpt.storage.manifest import _crc_of

    doc = _columns_manifest().to_json_dict()
    doc["manifest"] = json.loads(json.dumps(doc["manifest"]))  # tuples as JSON has them
    edit(doc["manifest"]["tensor_table"])  # type: ignore[operator]
    doc["crc32c"] = _crc_of(doc["manifest"])
    return doc


@pytest.mark.parametrize("edit,text", [
    (lambda t: t["offset"].append(80), "one length"),
    (lambda t: t.pop("device"), "device"),
    (lambda t: t.update(offset=[0, True]), "int values"),
    (lambda t: t.update(nbytes=[16, 8.0]), "int values"),
    (lambda t: t.update(shape=[[4, 2], 7]), "list/tuple values"),
    (lambda t: t.update(shape=[[4, "2"], []]), "shapes of ints"),
    (lambda t: t.update(key_path=["model/w", 3]), "str values"),
    (lambda t: t.update(offset=[0, 8]), "overlap"),
    (lambda t: t.update(nbytes=[17, 8]), "nbytes"),
])
def test_a_malformed_or_inconsistent_table_in_columns_is_corrupt(edit: object,
                                                                 text: str) -> None:
    with pytest.raises(CorruptShardError, match=text):
        ShardManifest.from_json_dict(_columns_edited(edit), "shard-x")


def test_many_tensors_are_saved_in_columns_and_few_in_rows(root: Path) -> None:
    import torch

    from localckpt import LocalCheckpointManager
    from localckpt.storage.manifest import COLUMNS_MIN_TENSORS

    many = {f"p{i}": torch.full((3,), float(i)) for i in range(COLUMNS_MIN_TENSORS)}
    with LocalCheckpointManager(root, "s", keep_last=2) as mgr:
        mgr.save(many, 1)
        mgr.save({"w": torch.ones(3)}, 2)
        store = mgr._ctx.store
        assert store.read_manifest(store.ref(1, 0, 1)).format_version == 6
        assert store.read_manifest(store.ref(2, 0, 1)).format_version == 1
    with LocalCheckpointManager(root, "s") as mgr:
        state, _ = mgr.load(iteration=1)
    assert all(torch.equal(state[k], v) for k, v in many.items())


@pytest.mark.parametrize("version", [4, 6])
@pytest.mark.parametrize("shape", [[0, 1 << 70], [10**4000, 0]])
def test_a_dimension_no_tensor_can_have_is_corrupt_at_once(version: int,
                                                          shape: list[int]) -> None:
    """An empty tensor of shape [0, 2**70] passed (the load then failed in torch.empty, the
    copy never quarantined), and dimensions of thousands of digits took math.prod seconds."""
    import time

    m = dataclasses.replace(_manifest(), format_version=version)
    doc = json.loads(json.dumps(m.to_json_dict()))
    body = doc["manifest"]
    if version == 6:
        body["tensor_table"]["shape"][1], body["tensor_table"]["nbytes"][1] = shape, 0
    else:
        body["tensors"][1].update(shape=shape, nbytes=0)
    from localckpt.storage.manifest import _crc_of

    doc["crc32c"] = _crc_of(body)
    started = time.monotonic()
    with pytest.raises(CorruptShardError, match="has shape"):
        ShardManifest.from_json_dict(doc, "shard-x")
    assert time.monotonic() - started < 1


def test_checking_the_table_by_columns_accepts_exactly_what_checking_each_entry_does() -> None:
    """The column-at-a-time check is the fast path of every load; the entry-by-entry check
    names the first failure. Random tables (in and out of offset order, empty tensors,
    several dtypes and devices) with random damage: both must agree on every one."""
    import math
    import random

    from localckpt.storage.tensor_table import _all_valid, _check_each

    rng = random.Random(7)
    sizes = {"float32": 4, "bfloat16": 2, "int64": 8, "bool": 1}

    def table() -> tuple[list[TensorEntry], int]:
        entries, offset = [], 0
        for i in range(rng.randint(1, 12)):
            dtype = rng.choice(list(sizes))
            shape = tuple(rng.choice([0, 1, 2, 3, 5]) for _ in range(rng.randint(0, 3)))
            nbytes = sizes[dtype] * math.prod(shape)
            entries.append(TensorEntry(f"k{i}", dtype, shape, offset, nbytes,
                                       rng.choice(["cpu", "cuda:0", "cuda:1", "npu:0"])))
            offset += nbytes + rng.choice([0, 0, 8])
        if rng.random() < 0.5:  # packed out of order (by dtype, as small host tensors are)
            spans = [(e.offset, e.nbytes) for e in entries]
            rng.shuffle(spans)
            entries = [e._replace(offset=o) if e.nbytes == n else e
                       for e, (o, n) in zip(entries, spans, strict=True)]
        return entries, offset + rng.choice([0, 0, 16])

    damages = [
        lambda e: e._replace(device="meta"), lambda e: e._replace(device="cuda:01"),
        lambda e: e._replace(dtype="float3"), lambda e: e._replace(shape=(-1, 2)),
        lambda e: e._replace(shape=(1 << 64,)), lambda e: e._replace(nbytes=e.nbytes + 1),
        lambda e: e._replace(offset=-4), lambda e: e._replace(offset=e.offset + 3),
        lambda e: e._replace(offset=e.offset - 2), lambda e: e._replace(offset=0),
    ]
    outcomes = set()
    for _ in range(3000):
        entries, data_nbytes = table()
        for _ in range(rng.choice([0, 0, 1, 2])):
            k = rng.randrange(len(entries))
            entries[k] = rng.choice(damages)(entries[k])
        data_nbytes -= rng.choice([0, 0, 0, 1])
        try:
            _check_each(tuple(entries), data_nbytes, CorruptShardError, "x")
            passes = True
        except (CorruptShardError, UnsupportedFormatError):
            passes = False
        assert _all_valid(tuple(entries), data_nbytes) == passes, (entries, data_nbytes)
        outcomes.add(passes)
    assert outcomes == {True, False}


def test_a_table_of_absurd_shapes_is_refused_fast_and_as_corruption() -> None:
    """200 forged entries of 3,000 dimensions of 2**63-1: the column check multiplied every
    shape out (10 s, every rank waiting in an exchange), and naming the first one raised a bare
    ValueError (a size of more than 4,300 digits) instead of CorruptShardError (from the review
    of this session's diff)."""
    import time

    from localckpt.storage.tensor_table import check_entries

    big = (1 << 63) - 1
    tensors = tuple(TensorEntry(f"t{i}", "float32", (big,) * 3000, 0, 4, "cpu")
                    for i in range(200))
    started = time.monotonic()
    with pytest.raises(CorruptShardError, match=r"t0.*shape"):
        check_entries(tensors, 4, CorruptShardError, "x")
    assert time.monotonic() - started < 1
