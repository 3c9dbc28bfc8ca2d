"""Small vectorized helpers over record columns (a `Columns` is a dict of equal-length arrays).

Rules take record batches the way `streams` and ClickHouse hand them over: one numpy array per
field of the record contract (`ingest.records`), e.g. ops → rank, comm_id, op_seq, op, bytes,
peer, t_enqueue, t_start, t_end. String columns (comm_id, op, nic) are object arrays. These
helpers turn string keys into integer codes and pick one row per group without Python loops over
rows.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Mapping

import numpy as np

Array = np.ndarray
Columns = Mapping[str, Array]


def n_rows(cols: Columns) -> int:
    """Number of rows (0 for an empty mapping)."""
    for v in cols.values():
        return int(np.asarray(v).shape[0])
    return 0


def distinct(x: Array) -> Array:
    """Sorted distinct values of a 1-D numeric array: `np.unique(x)` by one sort. numpy 2.4's
    `np.unique` without return options takes a hashing path that is two orders of magnitude
    slower than a sort when most of millions of values are distinct."""
    s = np.sort(np.asarray(x), kind="stable")
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


#: `search` sorts the needles only for a haystack past the CPU's caches (8 MiB of int64):
#: into a smaller one an unsorted search is as fast as the sort alone
_SEARCH_SORT_HAY = 1 << 20


def search(hay: Array, needles: Array, side: str = "left") -> Array:
    """`np.searchsorted(hay, needles, side)`, the same positions, with large needle arrays
    searched in ascending order: numpy's binary search starts each key's search from the
    previous key's position when the keys ascend, so the probes stay in cache. Into 6.5 M
    sorted keys (a 1,024-rank window's kernels), 1.5 M random keys cost 4× less CPU so, the
    needles' argsort included; into a haystack that fits the caches, sorting costs more than
    it saves, and the search is numpy's as it is (`_SEARCH_SORT_HAY`)."""
    needles = np.asarray(needles)
    if np.asarray(hay).size < _SEARCH_SORT_HAY or bool(np.all(needles[1:] >= needles[:-1])):
        return np.searchsorted(hay, needles, side=side)  # type: ignore[call-overload,no-any-return]
    order = np.argsort(needles, kind="stable")
    out = np.empty(needles.size, dtype=np.intp)
    out[order] = np.searchsorted(hay, needles[order], side=side)  # type: ignore[call-overload]
    return out


def col(cols: Columns, name: str, default: int | str | None = None) -> Array:
    """Column `name` as an array; a missing column is `default` repeated (error if None)."""
    if name in cols:
        return np.asarray(cols[name])
    if default is None:
        raise KeyError(f"column {name!r} is required; have {sorted(cols)}")
    n = n_rows(cols)
    if isinstance(default, str):
        return np.full(n, default, dtype=object)
    return np.full(n, default, dtype=np.int64)


def ints(cols: Columns, name: str, default: int | None = None) -> Array:
    """Column `name` as int64."""
    return col(cols, name, default).astype(np.int64, copy=False)


_CODES_MEMO: dict[int, tuple[weakref.ref[Array], Array, Array]] = {}
_MEMO_MIN_ROWS = 65_536
_OBJECT_IDS_MIN_ROWS = 4_096  # below, the per-row dict is as fast


def codes(values: Array) -> tuple[Array, Array]:
    """(uniques, codes) of a column: values == uniques[codes].

    Same result as `np.unique(values.astype(str), return_inverse=True)` for string columns, but
    factorized through a dict first (one hash per row) so only the few distinct values are
    sorted: sorting ~10⁶ unicode strings dominated root cause at 4k+ ranks. Large object
    columns (a window's comm_id, op) are factorized once: the result is remembered for as long
    as that array object lives (several rules code the same column) and returned read-only."""
    if values.dtype == object and values.size >= _MEMO_MIN_ROWS:
        hit = _CODES_MEMO.get(id(values))
        if hit is not None and hit[0]() is values:
            return hit[1], hit[2]
        uniq, inv = _codes(values)
        uniq.setflags(write=False)
        inv.setflags(write=False)
        key = id(values)
        _CODES_MEMO[key] = (weakref.ref(values, lambda _r: _CODES_MEMO.pop(key, None)), uniq, inv)
        return uniq, inv
    return _codes(values)


def coded_column(dictionary: Array, row_codes: Array) -> Array:
    """An object column from a dictionary-encoded one — a reader's LowCardinality result: the
    distinct values and one int code per row (`dictionary[row_codes]`) — with its factorization
    remembered, so `codes(column)` returns (sorted distinct values, codes) without reading the
    rows. The rows share the dictionary's string objects."""
    d = np.asarray(dictionary, dtype=object).reshape(-1)
    c = np.asarray(row_codes, dtype=np.int64).reshape(-1)
    column = d[c] if c.size else np.zeros(0, dtype=object)
    if c.size == 0:
        return column
    used = np.flatnonzero(np.bincount(c, minlength=d.size))
    uniq, remap = np.unique(np.asarray([str(x) for x in d[used].tolist()], dtype=str),
                            return_inverse=True)
    lut = np.full(d.size, -1, dtype=np.int64)
    lut[used] = remap.reshape(-1)
    inv = lut[c]
    uniq.setflags(write=False)
    inv.setflags(write=False)
    key = id(column)
    _CODES_MEMO[key] = (weakref.ref(column, lambda _r: _CODES_MEMO.pop(key, None)), uniq, inv)
    return column


def object_ids(values: Array) -> tuple[Array, Array]:
    """(rows, ids) of a 1-D object column: `rows` holds the first row of each distinct Python
    object in the column (ascending) and `ids[i]` is the index into `rows` of row i's object
    (values[i] is values[rows[ids[i]]] — the very same object, so also an equal value).

    Readers and decoders hand out the same string object for many rows (a dictionary-encoded
    column, one name per batch), so a column of 10⁶ rows often holds 10²-10⁵ objects. They are
    grouped by address — the object array's buffer of PyObject pointers, read as unsigned
    integers without touching the objects — with one sort of integers, after collapsing runs
    of the same object; no Python call per row. Equal values held by different objects get
    different ids: callers merge those (a dict over `rows`)."""
    v = np.ascontiguousarray(values).reshape(-1)
    n = v.size
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if v.dtype != object or v.itemsize != np.dtype(np.uintp).itemsize:
        raise TypeError(f"object_ids needs an object column, got dtype {v.dtype}")
    # a read-only view of the pointers; `v` holds the references for as long as it is read
    buf = memoryview((ctypes.c_size_t * n).from_address(v.ctypes.data)).cast("B")
    ptr = np.frombuffer(buf, dtype=np.uintp)
    heads = np.flatnonzero(np.r_[True, ptr[1:] != ptr[:-1]])  # runs of one object
    order = np.argsort(ptr[heads], kind="stable")
    sp = ptr[heads][order]
    new = np.r_[True, sp[1:] != sp[:-1]]
    head_id = np.empty(heads.size, dtype=np.int64)
    head_id[order] = np.cumsum(new) - 1
    # ids in order of first occurrence (stable sort: a group's first head is its first row)
    first = heads[order[new]]
    by_row = np.argsort(first, kind="stable")
    renum = np.empty(first.size, dtype=np.int64)
    renum[by_row] = np.arange(first.size)
    run_len = np.diff(np.r_[heads, n])
    return first[by_row].astype(np.int64), np.repeat(renum[head_id], run_len)


def _codes(values: Array) -> tuple[Array, Array]:
    if values.size == 0:
        return np.asarray([], dtype=values.dtype), np.zeros(0, dtype=np.int64)
    if values.dtype == object and values.ndim == 1 and values.size >= _OBJECT_IDS_MIN_ROWS:
        # code each distinct object once, then spread the codes over the rows
        rows, ids = object_ids(values)
        coded = _dict_codes(values[rows].tolist())
        if coded is not None:
            return coded[0], coded[1][ids]
    if values.dtype.kind in "OU":
        coded = _dict_codes(values.tolist())
        if coded is not None:
            return coded
    uniq, inv = np.unique(values.astype(str) if values.dtype == object else values,
                          return_inverse=True)
    return uniq, inv.astype(np.int64)


def _dict_codes(items: list[object]) -> tuple[Array, Array] | None:
    """(sorted distinct str forms, code per item), equal items merged by a dict; None when the
    items are unhashable (the caller then sorts their str forms)."""
    try:
        distinct = list(dict.fromkeys(items))
    except TypeError:
        return None
    if not distinct:
        return None
    uniq, remap = np.unique(np.asarray([str(k) for k in distinct], dtype=str),
                            return_inverse=True)
    code_of = dict(zip(distinct, remap.reshape(-1).tolist(), strict=True))
    return uniq, np.fromiter(map(code_of.__getitem__, items), dtype=np.int64, count=len(items))


def packed_key(*keys: Array) -> Array | None:
    """The composite key of each row packed into one int64, in the lexicographic order of the
    key tuples (each key offset by its minimum, scaled by the spans after it); None when the
    spans' product does not fit in 62 bits."""
    cols = [np.asarray(k, dtype=np.int64) for k in keys]
    lows = [int(c.min()) for c in cols]
    spans = [int(c.max()) - lo + 1 for c, lo in zip(cols, lows, strict=True)]
    total = 1
    for n in spans:
        total *= n
    if total >= 2**62:
        return None
    packed = np.zeros(cols[0].size, dtype=np.int64)
    for c, lo, n in zip(cols, lows, spans, strict=True):
        packed = packed * n + (c - lo)
    return packed


def all_distinct(*keys: Array) -> bool | None:
    """Whether no two rows share the composite key, by one sort of the packed key (None when
    it cannot be packed): the common case of a grouping that has nothing to merge, found at the
    cost of a sort instead of a grouping's."""
    if not keys or keys[0].size < 2:
        return True
    packed = packed_key(*keys)
    if packed is None:
        return None
    packed.sort()
    return not bool(np.any(packed[1:] == packed[:-1]))


def group_key(*keys: Array) -> tuple[Array, Array]:
    """Integer group id per row for a composite key; returns (group ids, first row of each).

    Group ids follow the lexicographic order of the key tuples (as `np.unique(axis=0)`); when the
    keys' ranges fit, they are packed into one int64 and grouped with a 1-D `np.unique` (stable
    sort: the first row of each group is its first occurrence) — ~10× faster than axis=0."""
    if not keys or keys[0].size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    packed = packed_key(*keys)
    if packed is not None:
        _, first, inv = np.unique(packed, return_index=True, return_inverse=True)
    else:
        stacked = np.stack([np.asarray(k, dtype=np.int64) for k in keys], axis=1)
        _, first, inv = np.unique(stacked, axis=0, return_index=True, return_inverse=True)
    return inv.reshape(-1).astype(np.int64), first.astype(np.int64)


def last_per_group(group: Array, order: Array) -> Array:
    """Row index of the row with the largest `order` in each group (groups 0..max)."""
    if group.size == 0:
        return np.zeros(0, dtype=np.int64)
    packed = _packed_last(group, order)
    if packed is not None:
        return packed
    idx = np.lexsort((order, group))
    g = group[idx]
    last = np.r_[g[1:] != g[:-1], True]
    return np.asarray(idx[last], dtype=np.int64)


def _packed_last(group: Array, order: Array) -> Array | None:
    """`last_per_group` by one value sort: (group, order, row) packed into one int64 when their
    ranges fit in 63 bits (ties on order go to the later row, as with the stable lexsort); a
    sort of values is ~2× an argsort of two keys at 10⁶ rows. None when they do not fit."""
    if group.dtype.kind not in "iu" or order.dtype.kind not in "iu":
        return None
    g = group.astype(np.int64, copy=False)
    o = order.astype(np.int64, copy=False)
    glo, olo = int(g.min()), int(o.min())
    gb = (int(g.max()) - glo).bit_length()
    ob = (int(o.max()) - olo).bit_length()
    rb = (g.size - 1).bit_length()
    if gb + ob + rb > 63:
        return None
    packed = ((g - glo) << (ob + rb)) | ((o - olo) << rb) | np.arange(g.size, dtype=np.int64)
    packed.sort()
    k = packed >> (ob + rb)
    return np.asarray(packed[np.r_[k[1:] != k[:-1], True]] & ((1 << rb) - 1), dtype=np.int64)


def group_reduce(group: Array, values: Array, n_groups: int, how: str) -> Array:
    """Per-group min/max/sum of `values` (float64; empty groups give nan for min/max, 0 for sum)."""
    v = values.astype(np.float64)
    if how == "sum":
        return np.bincount(group, weights=v, minlength=n_groups).astype(np.float64)
    out = np.full(n_groups, np.inf if how == "min" else -np.inf)
    (np.minimum if how == "min" else np.maximum).at(out, group, v)
    out[~np.isfinite(out)] = np.nan
    return out
