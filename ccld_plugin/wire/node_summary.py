"""One node's summaries in one store value, and which ranks make a node.

A node leader's agent publishes its node's per-rank summaries framed together (each one
encoded by ``wire.summary``, untouched), so the diagnoser reads one key per node instead
of one per rank. Nodes are runs of ``ranks_per_node`` consecutive global ranks, as
launchers number them (node n holds ranks n x size .. n x size + size - 1).

Frame: ``MAGIC``, the entry count (u16), then per entry its rank (u32) and length (u32),
then the summaries one after another, in entry order.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import numpy as np

from ccld_plugin.wire.packed import PackedSummaries, gather, records

__all__ = ["decode_node", "decode_nodes", "encode_node", "node_count", "node_of", "node_ranks"]

MAGIC = b"CCN1"
_HEAD = struct.Struct("<4sH")
_ENTRY = struct.Struct("<II")
_HEAD_DTYPE = np.dtype([("magic", "S4"), ("count", "<u2")])
_ENTRY_DTYPE = np.dtype([("rank", "<u4"), ("size", "<u4")])
assert _HEAD_DTYPE.itemsize == _HEAD.size and _ENTRY_DTYPE.itemsize == _ENTRY.size
MAX_ENTRIES = 0xFFFF


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def node_ranks(node: int, ranks_per_node: int, world: int) -> range:
    """The global ranks of ``node`` (the last node of a job may hold fewer)."""
    return range(node * ranks_per_node, min(world, (node + 1) * ranks_per_node))


def node_count(world: int, ranks_per_node: int) -> int:
    return -(-world // ranks_per_node)


def encode_node(summaries: Iterable[tuple[int, bytes]]) -> bytes:
    """The frame of ``(rank, summary)`` pairs."""
    items = list(summaries)
    if len(items) > MAX_ENTRIES:
        raise ValueError(f"a node frame holds at most {MAX_ENTRIES} summaries, not {len(items)}")
    head = [_HEAD.pack(MAGIC, len(items))]
    head += [_ENTRY.pack(rank, len(data)) for rank, data in items]
    return b"".join(head + [bytes(data) for _, data in items])


def decode_node(data: bytes, ranks: range) -> dict[int, bytes]:
    """The per-rank summaries in a frame of the node of ``ranks``. Raises ValueError when
    the frame is not one (bad magic, truncated, trailing bytes), or names a rank twice or
    a rank outside the node: a frame is taken whole or not at all. One frame, entry by
    entry, saying what is wrong with the first entry that is; a round's frames are read
    all at once by :func:`decode_nodes`."""
    if len(data) < _HEAD.size:
        raise ValueError(f"a node frame of {len(data)} bytes is shorter than its header")
    magic, count = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a node frame (magic {bytes(magic)!r})")
    pos = _HEAD.size + count * _ENTRY.size
    if pos > len(data):
        raise ValueError(f"a node frame of {count} entries is truncated ({len(data)} bytes)")
    entries = struct.unpack_from(f"<{2 * count}I", data, _HEAD.size)
    members, sizes = entries[::2], entries[1::2]
    out: dict[int, bytes] = {}
    for rank, size in zip(members, sizes, strict=True):
        if rank in out:
            raise ValueError(f"a node frame names rank {rank} twice")
        if rank not in ranks:
            raise ValueError(f"a node frame names rank {rank}, not of ranks {ranks.start}..")
        end = pos + size
        if end > len(data):
            raise ValueError(f"a node frame's summary of rank {rank} is truncated")
        out[rank] = data[pos:end]
        pos = end
    if pos != len(data):
        raise ValueError(f"a node frame has {len(data) - pos} bytes after its last summary")
    return out


def decode_nodes(
    frames: Sequence[tuple[int, bytes]], ranks_per_node: int, world: int
) -> tuple[PackedSummaries, dict[int, str]]:
    """The summaries in many ``(node, frame)`` pairs, packed where they lie in the frames
    joined (no summary is cut out: at tens of thousands of ranks each copy of a round's
    bytes costs ~10 ms); and, by node, why a frame is left out (what :func:`decode_node`
    raises for it). Every frame is checked as ``decode_node`` checks one, all at once."""
    values = [f for _, f in frames]
    nodes = np.fromiter((n for n, _ in frames), np.int64, len(frames))
    lens = np.fromiter(map(len, values), np.int64, len(values))
    blob = b"".join(values)
    starts = np.cumsum(lens) - lens
    ok = lens >= _HEAD_DTYPE.itemsize
    head = gather(blob, np.where(ok, starts, 0), _HEAD_DTYPE)
    ok &= head["magic"] == MAGIC
    counts = np.where(ok, head["count"].astype(np.int64), 0)
    data_at = starts + _HEAD_DTYPE.itemsize + _ENTRY_DTYPE.itemsize * counts
    ok &= data_at <= starts + lens
    counts = np.where(ok, counts, 0)
    entries, frame = records(blob, starts + _HEAD_DTYPE.itemsize, counts, _ENTRY_DTYPE)
    rank = entries["rank"].astype(np.int64)
    size = entries["size"].astype(np.int64)
    # each entry's rank is of its frame's node, and named once in it
    inside = (rank // ranks_per_node == nodes[frame]) & (rank < world)
    ok[frame[~inside]] = False
    named = np.bincount(rank[inside], minlength=world)
    ok[frame[inside & (named[np.where(inside, rank, 0)] > 1)]] = False
    # the summaries fill the frame exactly
    ok &= data_at + np.bincount(frame, weights=size, minlength=len(frames)).astype(np.int64) == (
        starts + lens
    )
    before = np.cumsum(size) - size  # the entry's offset among all entries' summaries
    first = (np.cumsum(counts) - counts)[frame]  # its frame's first entry
    at = data_at[frame] + before - before[first]
    keep = ok[frame]
    order = np.argsort(rank[keep], kind="stable")
    packed = PackedSummaries(blob, rank[keep][order], at[keep][order], size[keep][order])
    bad: dict[int, str] = {}
    for i in np.flatnonzero(~ok).tolist():
        n = int(nodes[i])
        try:  # its first fault, in words
            decode_node(values[i], node_ranks(n, ranks_per_node, world))
        except ValueError as exc:
            bad[n] = str(exc)
        else:  # the checks above are decode_node's: a frame one refuses, both refuse
            bad[n] = "a node frame that does not decode"
    return packed, bad
