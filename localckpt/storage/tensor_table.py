"""A shard's tensor table: each tensor's key path, dtype, shape, place in the packed data and
device (:class:`TensorEntry`), the stable names of the dtypes a shard holds, and the table read
from a manifest (rows in formats 1-5, columns in format 6) and checked entry by entry. Pure: no
I/O.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..errors import CorruptShardError, UnsupportedFormatError
from ..leaves import recorded_device_type

# torch dtype <-> stable name. Built from what this torch has, so float8 etc. appear when present.
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_ITEMSIZE = {name: dtype.itemsize for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Stable name of ``dtype``; raises TypeError for a dtype localckpt cannot store."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"unsupported tensor dtype: expected one of {sorted(_DTYPES)}, got {dtype}"
        ) from None


def dtype_from_name(name: str, where: str = "manifest") -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise UnsupportedFormatError(
            f"{where}: names dtype {name!r}, which this torch ({torch.__version__}) does not have"
        ) from None


class TensorEntry(NamedTuple):
    """One tensor's place in the packed data array. A named tuple, not a frozen dataclass: a
    shard of 7,500 tensors builds 7,500 of them on every save and every load, and a frozen
    dataclass takes four times as long to construct (9 ms against 2 ms)."""

    key_path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    device: str


_ENTRY_FIELDS = operator.itemgetter(*TensorEntry._fields)
_new_entry = tuple.__new__  # TensorEntry(...) goes through a Python __new__: a frame per entry


def entries_from_rows(items: list[Any]) -> tuple[TensorEntry, ...]:
    """The TensorEntry of each parsed JSON entry, its fields converted as ``str`` and ``int``
    take them (KeyError, TypeError, ValueError otherwise). Entries of the exact JSON types, as
    every writer produces them, skip the conversions: a load parses thousands."""
    out = []
    for item in items:
        key_path, dtype, shape, offset, nbytes, device = _ENTRY_FIELDS(item)
        if not (type(key_path) is str and type(dtype) is str and type(device) is str
                and type(offset) is int and type(nbytes) is int):
            key_path, dtype, device = str(key_path), str(dtype), str(device)
            offset, nbytes = int(offset), int(nbytes)
        out.append(_new_entry(TensorEntry, (key_path, dtype, tuple(map(int, shape)), offset,
                                            nbytes, device)))
    return tuple(out)


_FIELD_COUNT = len(TensorEntry._fields)
_ARRAYS = {list, tuple}
# A dimension a tensor can have (torch takes int64 sizes): larger ones, or thousands of digits
# that math.prod would multiply for seconds, mark a manifest no writer made.
_MAX_DIM = (1 << 63) - 1
# Elements no tensor holds (their bits, summed over the dimensions: multiplying out thousands
# of them takes a forged manifest's reader seconds), and the most dimensions the column check
# multiplies out (more: it leaves the entry to the check of each, which refuses the former).
_MAX_SIZE_BITS = 128
_FAST_MAX_DIMS = 64


def entries_from_columns(table: Any) -> tuple[TensorEntry, ...]:
    """The TensorEntry of each row of a version 6 tensor table: every column a list of the
    same length, of exact JSON types (as only this writer produces them): ValueError,
    TypeError, KeyError otherwise. Checked a column at a time, in C loops."""
    if type(table) is not dict:
        raise TypeError(f"tensor_table: expected an object, got {type(table).__name__}")
    columns = [table[name] for name in TensorEntry._fields]
    # lists as parsed; tuples as to_json_dict builds them (a manifest kept in memory)
    n = len(columns[0]) if type(columns[0]) in _ARRAYS else -1
    if any(type(c) not in _ARRAYS or len(c) != n for c in columns):
        raise ValueError(f"tensor_table: expected lists of one length, got "
                         f"{[type(c).__name__ for c in columns]} of lengths "
                         f"{[len(c) if type(c) in _ARRAYS else None for c in columns]}")
    if not n:
        return ()
    key_paths, dtypes, shapes, offsets, nbytes, devices = columns
    for column, kinds in ((key_paths, {str}), (dtypes, {str}), (devices, {str}),
                          (offsets, {int}), (nbytes, {int}), (shapes, _ARRAYS)):
        if not set(map(type, column)) <= kinds:
            raise TypeError(f"tensor_table: expected "
                            f"{'/'.join(sorted(k.__name__ for k in kinds))} values")
    if not set(map(type, itertools.chain.from_iterable(shapes))) <= {int}:
        raise TypeError("tensor_table: expected shapes of ints")
    return tuple(map(_new_entry, itertools.repeat(TensorEntry),
                     zip(key_paths, dtypes, map(tuple, shapes), offsets, nbytes, devices,
                         strict=True)))


def check_entries(tensors: tuple[TensorEntry, ...], data_nbytes: int,
                  bad: Callable[[str], CorruptShardError], where: str) -> None:
    """Raise for the first entry of ``tensors`` that fails a check: its device or dtype
    unknown, its shape not its bytes, lying outside the data or over another."""
    if not _all_valid(tensors, data_nbytes):
        _check_each(tensors, data_nbytes, bad, where)


def _all_valid(tensors: tuple[TensorEntry, ...], data_nbytes: int) -> bool:
    """Whether every entry passes every check of :func:`_check_each`, decided a column at a
    time in C loops (a load parses 10,000 entries: 13 ms one by one on this 2-core machine,
    about 4 column by column). False says only that one may fail: the caller then checks
    entry by entry to name the first."""
    if not tensors or data_nbytes >= 1 << 64:
        return not tensors
    _, dtypes, shapes, offsets, nbytes, devices = zip(*tensors, strict=True)
    if max(map(len, shapes)) > _FAST_MAX_DIMS:  # a forged shape: not multiplied out here
        return False
    for device in set(devices):
        try:
            if recorded_device_type(device) == "meta":
                return False
        except ValueError:
            return False
    itemsizes = list(map(_ITEMSIZE.get, dtypes))
    if None in itemsizes:
        return False
    dims = list(itertools.chain.from_iterable(shapes))
    if dims and (min(dims) < 0 or max(dims) > _MAX_DIM):
        return False
    if tuple(map(operator.mul, map(math.prod, shapes), itemsizes)) != nbytes:
        return False
    ends = tuple(map(operator.add, offsets, nbytes))
    if min(offsets) < 0 or max(ends) > data_nbytes:
        return False
    # No two tensors with bytes overlap: each ends before the next in offset order.
    starts = list(itertools.compress(offsets, nbytes))
    stops = list(itertools.compress(ends, nbytes))
    if not all(map(operator.le, stops, starts[1:])):  # packed out of order: sort first
        spans = sorted(zip(starts, stops, strict=True))
        starts, stops = [s for s, _ in spans], [e for _, e in spans]
        return all(map(operator.le, stops, starts[1:]))
    return True


def _check_each(tensors: tuple[TensorEntry, ...], data_nbytes: int,
                bad: Callable[[str], CorruptShardError], where: str) -> None:
    """:func:`check_entries` one entry at a time, raising for the first that fails."""
    devices: set[str] = set()
    end_of_last, in_order = 0, True
    itemsizes, prod = _ITEMSIZE, math.prod
    # One pass of few operations per entry: a load of 10,000 tensors checks 10,000.
    for i, (key_path, dtype, shape, offset, nbytes, device) in enumerate(tensors):
        if device not in devices:
            try:
                if recorded_device_type(device) == "meta":  # no bytes: no save names it
                    raise ValueError(device)
            except ValueError:
                raise bad(f"tensor {i} ({key_path}) names device {device!r}") from None
            devices.add(device)
        itemsize = itemsizes.get(dtype)
        if itemsize is None:
            dtype_from_name(dtype, where)  # raises UnsupportedFormatError
        if shape and (min(shape) < 0 or max(shape) > _MAX_DIM or (
                0 not in shape and sum(d.bit_length() for d in shape) > _MAX_SIZE_BITS)):
            raise bad(f"tensor {i} ({key_path}) has shape {str(list(shape))[:200]} "
                      f"({len(shape)} dimensions)")
        if prod(shape) * itemsize != nbytes:  # type: ignore[operator]
            raise bad(f"tensor {i} ({key_path}): shape {list(shape)} of {dtype} is "
                      f"{prod(shape) * itemsize} bytes, entry says nbytes={nbytes}")  # type: ignore[operator]
        if offset < 0:
            raise bad(f"tensor {i} ({key_path}) at offset {offset}")
        if offset + nbytes > data_nbytes:
            raise bad(f"tensor {i} ({key_path}) at [{offset}, {offset + nbytes}) lies "
                      f"beyond the {data_nbytes} data bytes")
        if nbytes:
            if offset < end_of_last:
                in_order = False
            end_of_last = offset + nbytes
    if not in_order:  # packed in order, no two can overlap; else two overlap only if two
        # neighbours in offset order do (small host tensors are packed by dtype, out of order)
        offsets = [e.offset for e in tensors]
        order = sorted((i for i, e in enumerate(tensors) if e.nbytes),
                       key=offsets.__getitem__)
        for a, b in itertools.pairwise(order):
            if offsets[b] < offsets[a] + tensors[a].nbytes:
                raise bad(f"tensors {a} and {b} overlap at byte {offsets[b]}")
