"""Per-session rows of batched arrays: a batched step splits its outputs into each session's row, and the next
step gathers the rows back without a copy when they are still the same composition.

On a GPU every small copy is a kernel launch: gathering sixteen sessions' rows one concatenation input each costs
sixteen launches per array, and `batched[i]` with an integer index is a gather of its own. `RowSources`
remembers which batched array each row is a view of, so the next step's gather is the batched array itself (same
sessions, same order), or one take from it.
"""

from __future__ import annotations

import functools

import mlx.core as mx


@functools.lru_cache(maxsize=8)
def take_index(index: tuple[int, ...]) -> mx.array:
    """`index` as an int32 array, made once for the many cache arrays a step gathers in the same order (on a GPU
    every array made from host values is a copy to the device)."""
    return mx.array(index, dtype=mx.int32)


class RowSources:
    """Which batched array each per-session row (a cache, a state, a random key) is a slice of, so the next
    batched step gathers the rows back with one copy per source array and one take, rather than one copy per
    session.

        rows = sources.split(batched)          # (B, ...) -> B rows of (1, ...), remembered
        again = sources.gather(rows)           # the same array, no copy; a subset or reorder is one take

    With `squeeze` the rows are (...) rather than (1, ...) (the mel streams' sample buffers, speech's keys). A
    user calls `keep` with the rows its sessions still hold now and then, so rows it dropped are forgotten.
    """

    def __init__(self):
        self._rows: dict[int, tuple[mx.array, mx.array, int]] = {}  # id(row) -> (row, batched, index)

    def split(self, batched: mx.array, squeeze: bool = False) -> list[mx.array]:
        # views, made in one call (half the host time of a slice per row, which a step of 16 sessions on the full
        # encoder makes some 800 times); an integer index (batched[b]) would be a gather, one copy per row
        rows = mx.split(batched, batched.shape[0], axis=0)
        if squeeze:
            rows = [row.squeeze(0) for row in rows]
        for b, row in enumerate(rows):
            self._rows[id(row)] = (row, batched, b)
        return rows

    def gather(self, rows: list[mx.array], squeeze: bool = False) -> mx.array:
        """rows: B arrays (1, ...) (with squeeze, (...)) of one shape -> (B, ...)."""
        sources: list[mx.array] = []
        offsets: dict[int, int] = {}
        index = []
        for row in rows:
            known = self._rows.get(id(row))
            if known is not None and known[0] is row:
                source, b = known[1], known[2]
            else:
                source, b = (row[None] if squeeze else row), 0
            if id(source) not in offsets:
                offsets[id(source)] = sum(a.shape[0] for a in sources)
                sources.append(source)
            index.append(offsets[id(source)] + b)
        stacked = sources[0] if len(sources) == 1 else mx.concatenate(sources, axis=0)
        if index == list(range(stacked.shape[0])):
            return stacked
        return stacked[take_index(tuple(index))]

    def keep(self, held: set[int]) -> None:
        """Forget every row whose id is not in `held` (the rows the live sessions still hold)."""
        self._rows = {k: v for k, v in self._rows.items() if k in held}
