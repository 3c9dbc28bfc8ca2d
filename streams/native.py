"""ClickHouse's Native format, written from numpy columns (the writer's insert body) and read
back into numpy columns (`read_columns`, query results).

One block: ``varint(columns) varint(rows)``, then per column its name, its type name and its
data. The data of the types the raw tables use:

- fixed-width numbers (`Int32`, `Int64`, `UInt32`, `UInt64`, `Float64`) and `DateTime64(p, tz)`
  (Int64 ticks): the values little-endian, back to back — one `tobytes` per column;
- `String`: per row ``varint(len) bytes``;
- `LowCardinality(String)`: a prefix ``UInt64 1`` (shared dictionaries with additional keys),
  then ``UInt64 flags`` (the index width 0..3 = UInt8..UInt64, plus bit 9, "has additional
  keys"), ``UInt64 keys``, the keys as `String` data, ``UInt64 rows`` and one index per row;
- `Array(T)` (from an object array of sequences: the topology's hosts and communicators): T's
  prefix first, then the cumulative end offsets as UInt64, then every element as one T column.

The body is the same for the embedded engine (``INSERT ... FROM INFILE ... FORMAT Native``) and a
server (``INSERT ... FORMAT Native`` over HTTP). Strings given as `ingest.batch.Coded` (codes +
distinct values) are written without a Python object per row: a LowCardinality column is its
dictionary plus the codes cast to the narrowest index type; a String column is gathered from the
encoded dictionary with numpy. Reading is the reverse for the same types, plus Date/DateTime;
numbers come out with one `frombuffer` per block and a LowCardinality column as one gather from
its dictionary. Pure: bytes in memory, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from ingest.batch import Coded

_FIXED: dict[str, str] = {"Int8": "<i1", "Int16": "<i2", "Int32": "<i4", "Int64": "<i8",
                          "UInt8": "<u1", "UInt16": "<u2", "UInt32": "<u4", "UInt64": "<u8",
                          "Float32": "<f4", "Float64": "<f8"}
_DATETIME64 = re.compile(r"^DateTime64\(\d(?:\s*,\s*'[^']*')?\)$")
_LOW_CARD_STRING = "LowCardinality(String)"
_HAS_ADDITIONAL_KEYS = 1 << 9
_SHARED_DICTIONARIES_WITH_ADDITIONAL_KEYS = 1

Column = np.ndarray | Coded


def supports(type_name: str) -> bool:
    """Whether `native_block` can write a column of this ClickHouse type."""
    if type_name.startswith("Array(") and type_name.endswith(")"):
        return supports(type_name[6:-1])
    return (type_name in _FIXED or type_name in ("String", _LOW_CARD_STRING)
            or bool(_DATETIME64.match(type_name)))


def varint(n: int) -> bytes:
    """ClickHouse's unsigned LEB128 length/count prefix."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _string(s: object) -> bytes:
    b = s if isinstance(s, bytes) else str(s).encode()
    return varint(len(b)) + b


def _u64(*values: int) -> bytes:
    return np.array(values, dtype="<u8").tobytes()


def _coded(col: Column) -> Coded:
    return col if isinstance(col, Coded) else Coded.factorize(col)


def _low_cardinality(col: Column) -> bytes:
    if not len(col):  # ClickHouse reads no dictionary for no rows (an array of empty arrays)
        return b""
    coded = _coded(col)
    keys = len(coded.values)
    width = 0 if keys <= 1 << 8 else 1 if keys <= 1 << 16 else 2 if keys <= 1 << 32 else 3
    index = coded.codes.astype(("<u1", "<u2", "<u4", "<u8")[width], copy=False)
    return b"".join((_u64(width | _HAS_ADDITIONAL_KEYS, keys),
                     *(_string(v) for v in coded.values),
                     _u64(len(index)), index.tobytes()))


def _strings(col: Column) -> bytes:
    if not isinstance(col, Coded):  # few rows (dead letters, metrics): one prefix per row
        return b"".join(_string(v) for v in col)
    encoded = [_string(v) for v in col.values]
    if not encoded or not len(col.codes):
        return b""
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    starts = np.cumsum(lengths) - lengths
    dictionary = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    row_len = lengths[col.codes]
    out_start = np.cumsum(row_len) - row_len
    # byte k of the output comes from dictionary byte starts[code] + (k - out_start[row])
    source = np.arange(int(row_len.sum()), dtype=np.int64)
    source += np.repeat(starts[col.codes] - out_start, row_len)
    return dictionary[source].tobytes()


def _prefix(type_name: str) -> bytes:
    """The state prefix written before a column's data (an array's is its elements')."""
    if type_name.startswith("Array("):
        return _prefix(type_name[6:-1])
    return _u64(_SHARED_DICTIONARIES_WITH_ADDITIONAL_KEYS) if type_name == _LOW_CARD_STRING \
        else b""


def _array(type_name: str, col: Column) -> bytes:
    """`Array(T)` from an object array of sequences: cumulative end offsets (UInt64), then all
    elements as one column of T (few rows: topologies)."""
    if isinstance(col, Coded):
        raise TypeError(f"string codes for a {type_name} column")
    lengths = np.fromiter((len(x) for x in col), dtype="<u8", count=len(col))
    elements = np.empty(int(lengths.sum()), dtype=object)
    for i, e in enumerate(e for x in col for e in x):  # nested sequences stay objects
        elements[i] = e
    inner = type_name[6:-1]
    if not inner.startswith("Array(") and "String" not in inner:
        elements = elements.astype(_FIXED.get(inner, "<i8"))
    return np.cumsum(lengths, dtype="<u8").tobytes() + _column_data(inner, elements, prefix=False)


def _column_data(type_name: str, col: Column, prefix: bool = True) -> bytes:
    if type_name.startswith("Array("):
        return (_prefix(type_name) if prefix else b"") + _array(type_name, col)
    if type_name == _LOW_CARD_STRING:
        return (_prefix(type_name) if prefix else b"") + _low_cardinality(col)
    if type_name == "String":
        return _strings(col)
    if isinstance(col, Coded):
        raise TypeError(f"string codes for a {type_name} column")
    dtype = _FIXED.get(type_name, "<i8")  # DateTime64: int64 ticks
    if col.dtype.kind == "M":
        col = col.view(np.int64)
    return np.ascontiguousarray(col, dtype=dtype).tobytes()


def native_block(columns: Sequence[tuple[str, str, Column]]) -> bytes:
    """One Native block of `(name, ClickHouse type, values)` columns of equal length. Raises
    ValueError on unequal lengths, TypeError on a type `supports` refuses."""
    lengths = {len(values) for _, _, values in columns}
    if len(lengths) > 1:
        raise ValueError(f"columns of unequal lengths {sorted(lengths)}")
    rows = lengths.pop() if lengths else 0
    parts = [varint(len(columns)), varint(rows)]
    for name, type_name, values in columns:
        if not supports(type_name):
            raise TypeError(f"column {name!r}: Native writer has no {type_name}")
        parts += [_string(name), _string(type_name), _column_data(type_name, values)]
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------
# Reading: query results as numpy columns

_DATETIME64_UNIT = {"3": "ms", "6": "us", "9": "ns"}
_NEED_GLOBAL_DICTIONARY = 1 << 8


class Unsupported(ValueError):
    """A result holds a type (or encoding) `read_columns` does not decode; use another reader."""


class _Source:
    def __init__(self, data: bytes) -> None:
        self.view, self.pos = memoryview(data), 0

    def take(self, size: int) -> memoryview:
        if self.pos + size > len(self.view):
            raise ValueError(f"Native data ends at byte {len(self.view)}, needed "
                             f"{self.pos + size}")
        out = self.view[self.pos:self.pos + size]
        self.pos += size
        return out

    def varint(self) -> int:
        shift = n = 0
        while True:
            b = self.take(1)[0]
            n |= (b & 0x7F) << shift
            if b < 0x80:
                return n
            shift += 7

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def strings(self, count: int) -> np.ndarray:
        out = np.empty(count, dtype=object)
        for i in range(count):  # one Python str per value: what the caller gets anyway
            out[i] = str(self.take(self.varint()), "utf-8", "replace")
        return out


def _numpy_type(type_name: str) -> tuple[str, str | None]:
    """(wire dtype, numpy view dtype or None) of a column type, or raise Unsupported."""
    if type_name in _FIXED:
        return _FIXED[type_name], None
    m = re.match(r"^DateTime64\((\d)(?:\s*,\s*'[^']*')?\)$", type_name)
    if m and m.group(1) in _DATETIME64_UNIT:
        return "<i8", f"datetime64[{_DATETIME64_UNIT[m.group(1)]}]"
    if re.match(r"^DateTime(?:\('[^']*'\))?$", type_name):
        return "<u4", "datetime64[s]"
    if type_name == "Date":
        return "<u2", "datetime64[D]"
    raise Unsupported(type_name)


def _read_column(src: _Source, type_name: str, rows: int, coded: bool) -> np.ndarray | Coded:
    if type_name == "String":
        return src.strings(rows)
    if type_name == _LOW_CARD_STRING:
        if src.u64() != _SHARED_DICTIONARIES_WITH_ADDITIONAL_KEYS:
            raise Unsupported("LowCardinality serialization version")
        flags = src.u64()
        if flags & _NEED_GLOBAL_DICTIONARY or not flags & _HAS_ADDITIONAL_KEYS:
            raise Unsupported("LowCardinality with a global dictionary")
        keys = src.strings(src.u64())
        if src.u64() != rows:
            raise ValueError(f"LowCardinality column with an index count other than {rows}")
        index = np.frombuffer(src.take(rows << (flags & 0xFF)),
                              dtype=("<u1", "<u2", "<u4", "<u8")[flags & 0xFF])
        if coded:
            return Coded(index.astype(np.int64), keys)
        column: np.ndarray = keys[index]
        return column
    wire, view = _numpy_type(type_name)
    size = np.dtype(wire).itemsize
    values = np.frombuffer(src.take(rows * size), dtype=wire).astype(wire[1:])
    return values.astype(view) if view else values


def read_columns(data: bytes, *, coded: bool = False
                 ) -> tuple[dict[str, np.ndarray | Coded], dict[str, str]]:
    """A Native result (any number of blocks) as numpy columns by name, with the column types:
    numbers as their numpy dtype, String and LowCardinality(String) as object arrays of str,
    DateTime64(3|6|9) as datetime64[ms|us|ns], DateTime as datetime64[s], Date as
    datetime64[D] — the dtypes clickhouse-connect's numpy results use. With `coded`,
    LowCardinality(String) columns come as `Coded` (codes + distinct values), no object per
    row. Raises Unsupported for other types (Nullable, Array, ...), before decoding any column
    of them."""
    src = _Source(data)
    parts: dict[str, list[np.ndarray | Coded]] = {}
    types: dict[str, str] = {}
    while src.pos < len(src.view):
        columns, rows = src.varint(), src.varint()
        for _ in range(columns):
            name = str(src.take(src.varint()), "utf-8")
            type_name = str(src.take(src.varint()), "utf-8")
            if type_name not in ("String", _LOW_CARD_STRING):
                _numpy_type(type_name)
            types[name] = type_name
            parts.setdefault(name, []).append(_read_column(src, type_name, rows, coded))
    return {name: _joined(p) for name, p in parts.items()}, types


def _joined(parts: list[np.ndarray | Coded]) -> np.ndarray | Coded:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], Coded):
        return Coded.concat([p for p in parts if isinstance(p, Coded)])
    return np.concatenate([p for p in parts if isinstance(p, np.ndarray)])
