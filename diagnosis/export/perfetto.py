"""A job's ops, stages and kernels as a Perfetto trace (protobuf), one track group per rank.

Written with the format's documented field numbers (perfetto/protos/perfetto/trace/
trace_packet.proto, track_event/track_event.proto, track_event/track_descriptor.proto and
debug_annotation.proto) by a small protobuf encoder, so rankwatch needs no Perfetto package at
run time; the tests read the file back with the `perfetto` package's own protobuf classes.

Layout (what ui.perfetto.dev shows): a top-level track per rank, "rank R · host", and under it
one child track per communicator for ops ("ops dp:world"), one for stages ("stages": each
step's six stage durations as consecutive slices from the step's start) and one per CUDA
stream for kernels ("kernels stream 7"). Ops on one communicator are sequential, as are a
stream's kernels, so slices on a track never overlap. An op still in flight at the end of the
span is a slice to the span's end named "<op> (in flight)".

Events go out as TYPE_SLICE_BEGIN / TYPE_SLICE_END packets sorted by time on one packet
sequence. This is an offline export: one Python loop over events, capped by the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

# field numbers (see the module docstring)
TRACE_PACKET = 1
PKT_TIMESTAMP, PKT_SEQ_ID, PKT_TRACK_EVENT, PKT_SEQ_FLAGS, PKT_TRACK_DESCRIPTOR = 8, 10, 11, 13, 60
TD_UUID, TD_NAME, TD_PARENT, TD_CHILD_ORDERING, TD_SIBLING_RANK = 1, 2, 5, 11, 12
TE_DEBUG, TE_TYPE, TE_TRACK_UUID, TE_CATEGORIES, TE_NAME = 4, 9, 11, 22, 23
DA_INT, DA_STRING, DA_NAME = 4, 6, 10
SLICE_BEGIN, SLICE_END = 1, 2
ORDER_EXPLICIT = 3
SEQ_INCREMENTAL_STATE_CLEARED = 1
SEQUENCE_ID = 1


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # negative int64 as two's complement, as protobuf does
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _key(field_no: int, wire: int) -> bytes:
    return _varint((field_no << 3) | wire)


def _int(field_no: int, v: int) -> bytes:
    return _key(field_no, 0) + _varint(v)


def _bytes(field_no: int, b: bytes) -> bytes:
    return _key(field_no, 2) + _varint(len(b)) + b


def _str(field_no: int, s: str) -> bytes:
    return _bytes(field_no, s.encode())


def track_descriptor(uuid: int, name: str, parent: int = 0, order: int | None = None) -> bytes:
    body = _int(TD_UUID, uuid) + _str(TD_NAME, name)
    if parent:
        body += _int(TD_PARENT, parent)
    body += _int(TD_CHILD_ORDERING, ORDER_EXPLICIT)
    if order is not None:
        body += _int(TD_SIBLING_RANK, order)
    return _bytes(TRACE_PACKET, _bytes(PKT_TRACK_DESCRIPTOR, body))


@functools.lru_cache(maxsize=4096)
def _string_annotation(name: str, value: str) -> bytes:
    return _bytes(TE_DEBUG, _str(DA_NAME, name) + _str(DA_STRING, value))


def annotation(name: str, value: int | str) -> bytes:
    if isinstance(value, str):
        return _string_annotation(name, value)
    return _bytes(TE_DEBUG, _str(DA_NAME, name) + _int(DA_INT, value))


_HEAD = _int(PKT_SEQ_ID, SEQUENCE_ID)


@functools.lru_cache(maxsize=65536)
def _static(track: int, name: str, category: str) -> tuple[bytes, bytes]:
    """The parts of a slice's begin and end events that depend only on track and name."""
    begin = (_int(TE_TYPE, SLICE_BEGIN) + _int(TE_TRACK_UUID, track)
             + _str(TE_CATEGORIES, category) + _str(TE_NAME, name))
    return begin, _int(TE_TYPE, SLICE_END) + _int(TE_TRACK_UUID, track)


def slice_packets(ts: int, end: int, track: int, name: str, category: str,
                  args: bytes = b"") -> tuple[bytes, bytes]:
    """(begin packet, end packet) of one slice."""
    begin, stop = _static(track, name, category)
    return (_bytes(TRACE_PACKET, _int(PKT_TIMESTAMP, ts) + _HEAD
                   + _bytes(PKT_TRACK_EVENT, begin + args)),
            _bytes(TRACE_PACKET, _int(PKT_TIMESTAMP, end) + _HEAD
                   + _bytes(PKT_TRACK_EVENT, stop)))


@dataclass
class TraceBuilder:
    """Collects tracks and slices; `to_bytes` writes the trace."""

    rank_names: dict[int, str] = field(default_factory=dict)
    _tracks: dict[tuple[int, str], int] = field(default_factory=dict)
    _children: dict[int, int] = field(default_factory=dict)
    #: (time, order within the time: ends before begins, packet)
    _events: list[tuple[int, int, bytes]] = field(default_factory=list)
    slices: int = 0

    def rank_track(self, rank: int) -> int:
        return (rank + 1) << 16

    def child_track(self, rank: int, name: str) -> int:
        key = (rank, name)
        uuid = self._tracks.get(key)
        if uuid is None:
            n = self._children.get(rank, 0)
            self._children[rank] = n + 1
            uuid = self._tracks[key] = self.rank_track(rank) + 1 + n
            self.rank_names.setdefault(rank, f"rank {rank}")
        return uuid

    def add(self, rank: int, track: str, ts: int, end: int, name: str, category: str,
            args: bytes = b"") -> None:
        end = max(end, ts)
        begin, stop = slice_packets(ts, end, self.child_track(rank, track), name, category, args)
        self._events.append((ts, 1, begin))
        self._events.append((end, 0, stop))
        self.slices += 1

    def ranks(self) -> int:
        return len({r for r, _ in self._tracks})

    def track_count(self) -> int:
        return len(self._tracks)

    def tracks(self) -> Iterator[bytes]:
        for rank in sorted(self.rank_names):
            yield track_descriptor(self.rank_track(rank), self.rank_names[rank], order=rank)
        for (rank, name), uuid in sorted(self._tracks.items()):
            order = 0 if name.startswith("stages") else 1 if name.startswith("ops") else 2
            yield track_descriptor(uuid, name, parent=self.rank_track(rank), order=order)

    def to_bytes(self) -> bytes:
        first = _bytes(TRACE_PACKET, _int(PKT_SEQ_ID, SEQUENCE_ID)
                       + _int(PKT_SEQ_FLAGS, SEQ_INCREMENTAL_STATE_CLEARED))
        self._events.sort(key=lambda e: (e[0], e[1]))
        return b"".join([first, *self.tracks(), *(e[2] for e in self._events)])


STAGE_NAMES = ("data.next_wait", "model.fwd_loss", "model.backward", "callbacks", "optim.step",
               "step.other")


def add_ops(b: TraceBuilder, ops: dict[str, np.ndarray], span_end: int) -> None:
    for r, comm, seq, op, nbytes, s, e in zip(ops["rank"].tolist(), ops["comm_id"].tolist(),
                                              ops["op_seq"].tolist(), ops["op"].tolist(),
                                              ops["bytes"].tolist(), ops["t_start"].tolist(),
                                              ops["t_end"].tolist(), strict=True):
        name = op if e > 0 else f"{op} (in flight)"
        args = (annotation("comm_id", comm) + annotation("op_seq", seq)
                + annotation("bytes", nbytes))
        b.add(r, f"ops {comm}", s, e if e > 0 else span_end, name, "op", args)


def add_stages(b: TraceBuilder, stages: dict[str, np.ndarray]) -> None:
    cols = ("data_next_wait", "model_fwd_loss", "model_backward", "callbacks", "optim_step",
            "step_other")
    durations = np.stack([stages[c] for c in cols], axis=1).clip(min=0)
    starts = stages["t_start"][:, None] + np.concatenate(
        [np.zeros((len(durations), 1), np.int64), durations.cumsum(axis=1)[:, :-1]], axis=1)
    for i, (r, step) in enumerate(zip(stages["rank"].tolist(), stages["step"].tolist(),
                                      strict=True)):
        for j, name in enumerate(STAGE_NAMES):
            d = int(durations[i, j])
            if d > 0:
                s = int(starts[i, j])
                b.add(r, "stages", s, s + d, name, "stage", annotation("step", step))


def add_kernels(b: TraceBuilder, kernels: dict[str, np.ndarray]) -> None:
    for r, stream, name, s, d in zip(kernels["rank"].tolist(), kernels["stream"].tolist(),
                                     kernels["kernel"].tolist(), kernels["t_start"].tolist(),
                                     kernels["duration"].tolist(), strict=True):
        b.add(r, f"kernels stream {stream}", s, s + max(0, d), name, "kernel")
