"""The columnar record-batch wire format (docs/records.md): one Kafka message = one batch.

    {"v": 1, "kind": "ops", "job_id": "j1", "producer": "host7/agent", "seq": 42, "n": 3,
     "cols": {"rank": [0, 1, 2], "comm_id": {"d": ["dp0"], "i": [0, 0, 0]}, ...}}

Integer columns are JSON arrays of integers, or packed (``{"le64": base64}``), or — in a framed
batch (``FRAME_MAGIC``, a uint32 header length, the JSON header, then a binary body) —
``{"at": byte offset}`` into the body, raw little-endian int64. String columns are
dictionary-encoded (``{"d": [distinct values], "i": [index per row]}``) or, for simple
producers, plain arrays of strings. A column the producer omits takes the model's default; a
required one must be present. The `jobs` kind carries ``"recs": [JobTopology, ...]`` instead
of ``"cols"``.

`encode_batch` and `decode_batch` work on whole numpy columns: no per-record model construction,
no per-row Python on the valid path. Validation applies the rules the pydantic models in
`ingest.records` declare, column-wise; the first violation raises `BatchError` naming the field,
the row and the reason. `decode_batch(data, coded=True)` keeps string columns dictionary-encoded
(`Coded`: codes + distinct values, in `RecordBatch.strings`) instead of building one Python
string reference per row: the raw sink's path, which stores them as LowCardinality codes.
"""

from __future__ import annotations

import base64
import binascii
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from ingest.records import COLUMNS, CONTRACT_VERSION, DERIVED, KINDS, Column, JobTopology

#: The column that carries a record's own time, used for lag metrics and time windows.
TIME_COLUMN: dict[str, str] = {
    "ops": "t_start",
    "flows": "t_start",
    "chunks": "ts",
    "stages": "t_start",
    "kernels": "t_start",
    "wr": "ts",
    "beats": "ts",
    "progress": "window_end",
    "iterations": "t_start",
    "kernel_summaries": "window_start",
}

MAX_ROWS = 4_000_000
#: The first bytes of a framed batch (never the start of a JSON text).
FRAME_MAGIC = b"RWB1"


class BatchError(ValueError):
    """A batch that breaks the contract. `field` and `row` locate the first violation (row -1: the
    whole batch or column)."""

    def __init__(self, reason: str, field: str = "", row: int = -1) -> None:
        self.reason, self.field, self.row = reason, field, row
        where = f"field {field!r}" if field else "batch"
        if row >= 0:
            where += f", row {row}"
        super().__init__(f"{where}: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {"field": self.field, "row": self.row, "reason": self.reason}


@dataclass(frozen=True)
class Coded:
    """A dictionary-encoded string column: row i is ``values[codes[i]]``.

    `codes` are int64 in ``[0, len(values))``; `values` is an object array of str (entries no
    row uses may be "" — a bad unused entry of the producer's dictionary is blanked, not kept).
    """

    codes: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.codes)

    def strings(self) -> np.ndarray:
        """The column as an object array of str, one reference per row."""
        return self.values[self.codes] if len(self.codes) else np.empty(0, object)

    @classmethod
    def factorize(cls, strings: np.ndarray | Sequence[str]) -> Coded:
        """Codes in order of first appearance (one dict lookup per row: for small columns)."""
        codes, dictionary = _dict_encode(strings)
        return cls(codes, _objects(dictionary))

    @classmethod
    def concat(cls, parts: Sequence[Coded]) -> Coded:
        """`parts` back to back with one dictionary of distinct values: one dict lookup per
        dictionary entry of each part (in C), one numpy gather per part for the codes."""
        if len(parts) == 1 and len(set(parts[0].values)) == len(parts[0].values):
            return parts[0]
        values = [p.values.tolist() for p in parts]
        # the distinct values in order of first appearance, and each one's code: built and
        # looked up in C (`dict.fromkeys`, `map`), not one Python frame per entry
        index = dict.fromkeys(itertools.chain.from_iterable(values))
        code = dict(zip(index, range(len(index)), strict=True)).__getitem__
        codes = []
        for p, v in zip(parts, values, strict=True):
            remap = np.fromiter(map(code, v), np.int64, count=len(v))
            codes.append(remap[p.codes] if len(p.codes) else p.codes.astype(np.int64))
        return cls(np.concatenate(codes) if codes else np.empty(0, np.int64),
                   _objects(list(index)))


@dataclass
class RecordBatch:
    """A decoded batch: numpy columns (int columns typed, string columns as object arrays).

    Decoded with ``coded=True``, string columns are in `strings` as `Coded` and not in `cols`.
    """

    kind: str
    job_id: str
    producer: str
    seq: int
    cols: dict[str, np.ndarray] = field(default_factory=dict)
    topologies: list[JobTopology] = field(default_factory=list)
    strings: dict[str, Coded] = field(default_factory=dict)

    @property
    def n(self) -> int:
        if self.kind == "jobs":
            return len(self.topologies)
        for columns in (self.cols, self.strings):
            for c in columns.values():
                return len(c)
        return 0

    def column(self, name: str) -> np.ndarray:
        """Column `name` as numpy, string columns as object arrays however they were decoded."""
        coded = self.strings.get(name)
        return coded.strings() if coded is not None else self.cols[name]


# ---------------------------------------------------------------------------------------------
# Encoding


class _Body:
    """Where integer columns go while encoding: base64 text, plain arrays, or a framed body."""

    def __init__(self, packed: bool, framed: bool) -> None:
        self.packed, self.framed = packed, framed
        self.parts: list[bytes] = []
        self.size = 0

    def ints(self, values: Any) -> Any:
        arr = np.ascontiguousarray(values, dtype="<i8")
        if self.framed:
            at = self.size
            self.parts.append(arr.tobytes())
            self.size += arr.nbytes
            return {"at": at}
        if self.packed:
            return {"le64": base64.b64encode(arr.tobytes()).decode("ascii")}
        return arr


def _objects(values: Sequence[Any]) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def _dict_encode(values: np.ndarray | Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """Codes in order of first appearance and the distinct values: two passes of dict
    operations driven from C (`dict.fromkeys`, `map`), no Python frame per row."""
    seq = values.tolist() if isinstance(values, np.ndarray) else values
    index = dict.fromkeys(seq)
    code = dict(zip(index, range(len(index)), strict=True)).__getitem__
    return np.fromiter(map(code, seq), dtype=np.int64, count=len(seq)), list(index)


def encode_batch(
    kind: str,
    job_id: str,
    cols: Mapping[str, Any],
    *,
    producer: str = "",
    seq: int = 0,
    validate: bool = True,
    packed: bool = True,
    framing: str = "json",
) -> bytes:
    """Encode one batch of `kind` from numpy columns (or sequences). String columns may also be
    given pre-encoded as ``(codes, dictionary)`` to skip factorization. Validates by default, so a
    producer learns of a bug at the source rather than in the dead-letter topic. `packed` writes
    integer columns as base64 little-endian int64 (``{"le64": "..."}``), several times faster to
    decode than JSON arrays of numbers; `packed=False` writes plain arrays. `framing="binary"`
    writes a framed batch (`FRAME_MAGIC`, docs/records.md): the same header, integer columns as
    raw little-endian int64 after it — no base64 at either end; readers before it reject it."""
    if framing not in ("json", "binary"):
        raise ValueError(f"framing must be 'json' or 'binary', got {framing!r}")
    body = _Body(packed, framing == "binary")
    if kind == "jobs":
        raise BatchError("use encode_topology for the jobs kind", "kind")
    spec = _spec(kind)
    unknown = set(cols) - {c.name for c in spec}
    if unknown:
        raise BatchError(f"unknown columns {sorted(unknown)} for kind {kind!r}", sorted(unknown)[0])
    out: dict[str, Any] = {}
    n = -1
    for c in spec:
        if c.name not in cols:
            continue
        v = cols[c.name]
        if c.kind == "str":
            if isinstance(v, tuple) and len(v) == 2:
                codes, dictionary = np.asarray(v[0]), list(v[1])
            else:
                codes, dictionary = _dict_encode(v)
            m = len(codes)
            out[c.name] = {"d": dictionary, "i": body.ints(codes)}
        else:
            arr = np.asarray(v)
            m = len(arr)
            out[c.name] = body.ints(arr)
        if n >= 0 and m != n:
            raise BatchError(f"column has {m} rows, others have {n}", c.name)
        n = m
    n = max(n, 0)
    doc = {"v": CONTRACT_VERSION, "kind": kind, "job_id": job_id, "producer": producer,
           "seq": seq, "n": n, "cols": out}
    data = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if body.framed:
        data = _frame(data, body.parts)
    if validate:
        decode_batch(data)
    return data


def _frame(header: bytes, parts: list[bytes]) -> bytes:
    pad = -(len(FRAME_MAGIC) + 4 + len(header)) % 8  # the body starts 8-byte aligned
    header += b" " * pad
    return b"".join((FRAME_MAGIC, len(header).to_bytes(4, "little"), header, *parts))


def encode_topology(topo: JobTopology | Sequence[JobTopology], *, producer: str = "") -> bytes:
    topos = [topo] if isinstance(topo, JobTopology) else list(topo)
    if not topos:
        raise BatchError("a jobs batch needs at least one topology", "recs")
    doc = {"v": CONTRACT_VERSION, "kind": "jobs", "job_id": topos[0].job_id, "producer": producer,
           "seq": 0, "n": len(topos), "recs": [t.model_dump() for t in topos]}
    return orjson.dumps(doc)


# ---------------------------------------------------------------------------------------------
# Decoding and validation


def _spec(kind: str) -> tuple[Column, ...]:
    spec = COLUMNS.get(kind)
    if spec is None:
        raise BatchError(f"unknown kind {kind!r}; expected one of "
                         f"{', '.join((*KINDS, *DERIVED))}", "kind")
    return spec


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _unpack(c: Column, raw: dict[str, Any]) -> np.ndarray:
    text = raw.get("le64")
    if set(raw) != {"le64"} or not isinstance(text, str):
        raise BatchError('expected an array of integers or {"le64": base64}', c.name)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BatchError("le64 is not valid base64", c.name) from None
    if len(data) % 8:
        raise BatchError(f"le64 holds {len(data)} bytes, not a whole number of int64", c.name)
    return np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False)


def _at(c: Column, raw: dict[str, Any], n: int, body: memoryview) -> np.ndarray:
    """A framed batch's column: n int64 little-endian at byte `at` of the body."""
    at = raw.get("at")
    if set(raw) != {"at"} or type(at) is not int or at < 0:
        raise BatchError('expected {"at": byte offset >= 0}', c.name)
    if at + 8 * n > len(body):
        raise BatchError(f"column at byte {at} with {n} rows runs past the body "
                         f"({len(body)} bytes)", c.name)
    return np.frombuffer(body, dtype="<i8", count=n, offset=at)


def _int_column(c: Column, raw: Any, n: int, body: memoryview | None = None) -> np.ndarray:
    if isinstance(raw, dict):
        arr = _unpack(c, raw) if body is None or "le64" in raw else _at(c, raw, n, body)
        return _check_ints(c, arr.astype(np.int64, copy=False), n)
    if not isinstance(raw, list):
        raise BatchError(f"expected an array of integers, got {type(raw).__name__}", c.name)
    try:
        arr = np.asarray(raw)
    except (ValueError, OverflowError):
        arr = np.asarray(raw, dtype=object)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and len(raw)):
        for i, x in enumerate(raw):
            if type(x) is not int:
                raise BatchError(f"expected an integer, got {x!r}", c.name, i)
            if not -(1 << 63) <= x < (1 << 63):
                raise BatchError(f"{x} is out of the int64 range", c.name, i)
        raise BatchError("expected a flat array of integers", c.name)
    if arr.dtype.kind == "u":
        big = arr > np.iinfo(np.int64).max
        if big.any():
            raise BatchError(f"{arr[big][0]} is out of the int64 range", c.name, _first(big))
    return _check_ints(c, arr.astype(np.int64, copy=False), n)


def _check_ints(c: Column, arr: np.ndarray, n: int) -> np.ndarray:
    if len(arr) != n:
        raise BatchError(f"column has {len(arr)} rows, batch says n={n}", c.name)
    if c.ge is not None and len(arr):
        bad = arr < c.ge
        if bad.any():
            i = _first(bad)
            raise BatchError(f"{arr[i]} is below the minimum {c.ge}", c.name, i)
    if c.lt is not None and len(arr):
        bad = arr >= c.lt
        if bad.any():
            i = _first(bad)
            raise BatchError(f"{arr[i]} is not below the limit {c.lt}", c.name, i)
    return arr.astype(c.dtype, copy=False)


def _bad_strings(c: Column, values: Sequence[Any]) -> np.ndarray:
    """Positions of the `values` that break the column's rules (`_check_str`), ascending. The
    types, lengths and membership of a closed set are taken in C (`map` over the values), so a
    dictionary of a few hundred entries per message costs no Python frame per entry; only a
    bad entry's reason is worded one by one."""
    if not values:
        return np.empty(0, np.int64)
    if set(map(type, values)) != {str}:  # a non-string (or a str subclass): word each one
        return np.flatnonzero([_check_str(c, s) is not None for s in values])
    n = len(values)
    lens = np.fromiter(map(len, values), np.int64, count=n)
    bad = lens < c.min_len
    if c.max_len is not None:
        bad |= lens > c.max_len
    if c.choices is not None and not c.choices.issuperset(values):
        bad |= ~np.fromiter(map(c.choices.__contains__, values), bool, count=n)
    return np.flatnonzero(bad)


def _check_str(c: Column, s: Any) -> str | None:
    """The reason a string value breaks the column's rules, or None."""
    if type(s) is not str:
        return f"expected a string, got {s!r}"
    if len(s) < c.min_len:
        return "empty string is not allowed"
    if c.max_len is not None and len(s) > c.max_len:
        return f"string of length {len(s)} exceeds {c.max_len}"
    if c.choices is not None and s not in c.choices:
        return f"{s!r} is not one of {sorted(c.choices)}"
    return None


def _str_column(c: Column, raw: Any, n: int, body: memoryview | None) -> Coded | np.ndarray:
    """A string column: `Coded` from a dictionary-encoded one, an object array from a plain one
    (the caller factorizes it when it wants codes)."""
    if isinstance(raw, list):
        if len(raw) != n:
            raise BatchError(f"column has {len(raw)} rows, batch says n={n}", c.name)
        if raw and set(map(type, raw)) != {str}:
            row = next(i for i, s in enumerate(raw) if type(s) is not str)
            raise BatchError(f"expected a string, got {raw[row]!r}", c.name, row)
        distinct = list(dict.fromkeys(raw))  # each distinct value checked once
        bad = _bad_strings(c, distinct)
        if len(bad):  # the first in order of appearance: the lowest row that breaks a rule
            s = distinct[int(bad[0])]
            raise BatchError(str(_check_str(c, s)), c.name, raw.index(s))
        return _objects(raw)
    if not isinstance(raw, dict) or set(raw) != {"d", "i"} or not isinstance(raw["d"], list):
        raise BatchError('expected an array of strings or {"d": [...], "i": [...]}', c.name)
    dictionary = raw["d"]
    codes = _int_column(
        Column(c.name, "int", np.dtype(np.int64), True, None, 0, max(len(dictionary), 1)),
        raw["i"], n, body)
    lookup = _objects(dictionary)
    bad = _bad_strings(c, dictionary)
    if len(bad):
        # an unused bad entry harms nothing; a used one names the first row using one
        rows = np.flatnonzero(np.isin(codes, bad))
        if len(rows):
            row = int(rows[0])
            raise BatchError(str(_check_str(c, dictionary[int(codes[row])])), c.name, row)
        lookup[bad] = ""  # never stored, but must not reach a writer as a non-string
    return Coded(codes, lookup)


def decode_batch(data: bytes, *, coded: bool = False) -> RecordBatch:
    """Decode and validate one message. Raises `BatchError`; never returns a partial batch.

    `coded`: string columns go to `RecordBatch.strings` as `Coded` (plain string arrays are
    factorized) instead of `cols` as object arrays."""
    body: memoryview | None = None
    header: bytes | memoryview = data
    if data[:len(FRAME_MAGIC)] == FRAME_MAGIC:
        header, body = _unframe(data)
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as e:
        raise BatchError(f"not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BatchError("a batch must be a JSON object")
    if doc.get("v") != CONTRACT_VERSION:
        raise BatchError(f"unsupported version {doc.get('v')!r}; this reader speaks "
                         f"v{CONTRACT_VERSION}", "v")
    kind = doc.get("kind")
    if not isinstance(kind, str):
        raise BatchError("missing kind", "kind")
    job_id, producer, seq = doc.get("job_id"), doc.get("producer", ""), doc.get("seq", 0)
    if not isinstance(job_id, str) or not job_id or len(job_id) > 256:
        raise BatchError("job_id must be a non-empty string of at most 256 characters", "job_id")
    if not isinstance(producer, str):
        raise BatchError("producer must be a string", "producer")
    if type(seq) is not int or seq < 0:
        raise BatchError("seq must be a non-negative integer", "seq")
    n = doc.get("n")
    if type(n) is not int or not 0 <= n <= MAX_ROWS:
        raise BatchError(f"n must be an integer in [0, {MAX_ROWS}]", "n")
    if kind == "jobs":
        return _decode_jobs(doc, job_id, producer, seq, n)
    spec = _spec(kind)
    raw_cols = doc.get("cols")
    if not isinstance(raw_cols, dict):
        raise BatchError("missing cols object", "cols")
    unknown = set(raw_cols) - {c.name for c in spec}
    if unknown:
        raise BatchError(f"unknown column for kind {kind!r}", sorted(unknown)[0])
    cols: dict[str, np.ndarray] = {}
    strings: dict[str, Coded] = {}
    for c in spec:
        raw = raw_cols.get(c.name)
        if raw is None and c.required:
            raise BatchError("required column is missing", c.name)
        if c.kind == "int":
            cols[c.name] = (np.full(n, c.default, dtype=c.dtype) if raw is None
                            else _int_column(c, raw, n, body))
            continue
        col = (Coded(np.zeros(n, np.int64), _objects([c.default])) if raw is None
               else _str_column(c, raw, n, body))
        if not coded:
            cols[c.name] = col.strings() if isinstance(col, Coded) else col
        else:
            strings[c.name] = col if isinstance(col, Coded) else Coded.factorize(col)
    return RecordBatch(kind, job_id, producer, seq, cols, strings=strings)


def _unframe(data: bytes) -> tuple[memoryview, memoryview]:
    """A framed batch's JSON header and body (views of `data`, no copy)."""
    view = memoryview(data)
    start = len(FRAME_MAGIC) + 4
    if len(view) < start:
        raise BatchError("framed batch shorter than its header length")
    size = int.from_bytes(view[len(FRAME_MAGIC):start], "little")
    if start + size > len(view):
        raise BatchError(f"framed batch header of {size} bytes runs past the message "
                         f"({len(view)} bytes)")
    return view[start:start + size], view[start + size:]


def _decode_jobs(doc: dict[str, Any], job_id: str, producer: str, seq: int, n: int) -> RecordBatch:
    recs = doc.get("recs")
    if not isinstance(recs, list) or len(recs) != n:
        raise BatchError("jobs batch needs recs, an array of n topologies", "recs")
    topos = []
    for i, r in enumerate(recs):
        try:
            topos.append(JobTopology.model_validate(r))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "recs"
            raise BatchError(err["msg"], loc, i) from None
    return RecordBatch("jobs", job_id, producer, seq, topologies=topos)
