"""Many ranks' encoded summaries side by side in one buffer, and the numpy gathers that
read packed records out of such a buffer.

At tens of thousands of ranks a round's summaries are ~10 MB, and on a busy host each
copy of them costs ~10 ms: the node frames the control plane reads are joined once, and
the summaries in them are located (rank, start, length) instead of being cut out one by
one; ``SummaryTable.decode`` reads them in place. A rank's own bytes are sliced only when
asked for (a verdict's few ranks, a recording).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

__all__ = ["PackedSummaries", "gather", "opaque", "records"]


class PackedSummaries(Mapping[int, bytes]):
    """Encoded summaries by rank: ``blob[starts[i] : starts[i] + lens[i]]`` is rank
    ``ranks[i]``'s; ranks ascending, each once."""

    def __init__(
        self, blob: bytes, ranks: np.ndarray, starts: np.ndarray, lens: np.ndarray
    ) -> None:
        self.blob = blob
        self.ranks = ranks.astype(np.int64, copy=False)
        self.starts = starts.astype(np.int64, copy=False)
        self.lens = lens.astype(np.int64, copy=False)
        self._index: dict[int, int] | None = None

    @classmethod
    def of(cls, values: Mapping[int, bytes]) -> PackedSummaries:
        """``values`` packed (a copy of their bytes)."""
        if isinstance(values, PackedSummaries):
            return values
        ranks = sorted(values)
        parts = [bytes(values[r]) for r in ranks]
        lens = np.fromiter(map(len, parts), np.int64, len(parts))
        return cls(b"".join(parts), np.array(ranks, np.int64), np.cumsum(lens) - lens, lens)

    def select(self, keep: np.ndarray) -> PackedSummaries:
        """The ranks where ``keep`` (a bool per rank, in order) is set; the buffer shared."""
        return PackedSummaries(self.blob, self.ranks[keep], self.starts[keep], self.lens[keep])

    def merged(self, newer: Mapping[int, bytes]) -> PackedSummaries:
        """These summaries with ``newer``'s in place of or beside them. When ``newer`` holds
        every rank here (a round that heard from all), it is the answer, uncopied; else
        the bytes are copied once."""
        if not newer:
            return self
        if isinstance(newer, PackedSummaries) and np.isin(self.ranks, newer.ranks).all():
            return newer
        newer = PackedSummaries.of(newer)
        keep = ~np.isin(self.ranks, newer.ranks)
        ranks = np.concatenate([self.ranks[keep], newer.ranks])
        starts = np.concatenate([self.starts[keep], newer.starts + len(self.blob)])
        lens = np.concatenate([self.lens[keep], newer.lens])
        order = np.argsort(ranks, kind="stable")
        return PackedSummaries(self.blob + newer.blob, ranks[order], starts[order], lens[order])

    # ------------------------------------------------------------------ mapping
    def _row(self, rank: object) -> int | None:
        if self._index is None:
            self._index = {r: i for i, r in enumerate(self.ranks.tolist())}
        return self._index.get(rank) if isinstance(rank, int) else None

    def __getitem__(self, rank: int) -> bytes:
        i = self._row(rank)
        if i is None:
            raise KeyError(rank)
        return self.at_row(i)

    def at_row(self, i: int) -> bytes:
        """The summary of the ``i``-th rank (in rank order)."""
        start = int(self.starts[i])
        return self.blob[start : start + int(self.lens[i])]

    def __contains__(self, rank: object) -> bool:
        return self._row(rank) is not None

    def __iter__(self) -> Iterator[int]:
        return iter(self.ranks.tolist())

    def __len__(self) -> int:
        return len(self.ranks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedSummaries):
            return super().__eq__(other)
        if not (np.array_equal(self.ranks, other.ranks) and np.array_equal(self.lens, other.lens)):
            return False
        if np.array_equal(self.starts, other.starts) and len(self.blob) == len(other.blob):
            return self.blob == other.blob  # laid out alike: one comparison of the buffers
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # a mapping, compared by value


def opaque(dtype: np.dtype) -> np.dtype:
    """Records of ``dtype``'s size, seen as opaque bytes: numpy copies those with one
    memcpy each, structured records field by field (unaligned ones 50x slower)."""
    return np.dtype((np.void, dtype.itemsize))


def gather(blob: bytes, at: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The records of ``dtype`` that start at the byte offsets ``at`` of ``blob``: one
    fancy index over a view of the bytes with an ``opaque`` record at every offset, read
    as ``dtype`` once copied."""
    if len(at) == 0 or len(blob) < dtype.itemsize:
        return np.zeros(len(at), dtype)
    every = np.ndarray((len(blob) - dtype.itemsize + 1,), opaque(dtype), blob, 0, (1,))
    return every[at].view(dtype)


def records(
    blob: bytes, first: np.ndarray, counts: np.ndarray, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``counts`` records of ``dtype``, side by side from ``first``, and the
    row of each."""
    rows = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    before = np.cumsum(counts) - counts
    at = first[rows] + (np.arange(len(rows), dtype=np.int64) - before[rows]) * dtype.itemsize
    return gather(blob, at, dtype), rows
