"""A per-session random key that replays MLX's global generator after `mx.random.seed(seed)`.

MLX's global generator splits its key on every draw, keeps the first half and draws with the second. A
session that does the same on its own key gets the very numbers a process-global run would, without ever
touching (or being disturbed by) the global state:

    >>> rng = SessionKey(0); u = rng.uniform((1, 1, 4))
    >>> mx.random.seed(0); mx.array_equal(u, mx.random.uniform(shape=(1, 1, 4))).item()
    True
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx

from services.common.cache import RowSources


class SessionKey:
    """The key sequence of `mx.random.seed(seed)`; every draw consumes one split. `key` is the current key, (2,)
    uint32 (a batched draw, `take_batch`, replaces it)."""

    def __init__(self, seed: int):
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        self.key = mx.random.key(seed)

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def uniform(self, shape: tuple[int, ...]) -> mx.array:
        """U[0, 1) float32 of `shape`, as `mx.random.uniform(shape=shape)` would draw it."""
        return mx.random.uniform(shape=shape, key=self.next_key())

    def normal(self, shape: tuple[int, ...]) -> mx.array:
        """N(0, 1) float32 of `shape`, as `mx.random.normal(shape)` would draw it."""
        return mx.random.normal(shape, key=self.next_key())

    def take(self, count: int) -> mx.array:
        """The next `count` draw keys, (count, 2) uint32: what `count` draws would use, in order."""
        return mx.stack([self.next_key() for _ in range(count)])


class KeySequence:
    """Draws with keys taken in advance (`SessionKey.take`), so a compiled function can receive them as input."""

    def __init__(self, keys: mx.array):
        self._keys = keys
        self._next = 0

    def _key(self) -> mx.array:
        key = self._keys[self._next]
        self._next += 1
        return key

    def uniform(self, shape: tuple[int, ...]) -> mx.array:
        return mx.random.uniform(shape=shape, key=self._key())

    def normal(self, shape: tuple[int, ...]) -> mx.array:
        return mx.random.normal(shape, key=self._key())


@functools.cache
def _split_chain(count: int):
    """keys (B, 2) -> (the keys after `count` splits (B, 2), the `count` draw keys (B, count, 2)), row by row."""
    split_rows = mx.vmap(mx.random.split)

    def chain(keys: mx.array) -> tuple[mx.array, mx.array]:
        subs = []
        for _ in range(count):
            pair = split_rows(keys)  # (B, 2, 2): the kept half, the drawn half
            keys = pair[:, 0]
            subs.append(pair[:, 1])
        return keys, mx.stack(subs, axis=1)

    return mx.compile(chain)


def take_batch(rngs: Sequence[SessionKey], count: int, rows: RowSources | None = None) -> mx.array:
    """`mx.stack([rng.take(count) for rng in rngs])`, (B, count, 2), split for all sessions at once. With
    `rows`, each session's new key is a row of the batch's array there, so the same sessions' next batch takes
    their keys back without a copy per session."""
    rows = rows or RowSources()
    keys, subs = _split_chain(count)(rows.gather([rng.key for rng in rngs], squeeze=True))
    for rng, key in zip(rngs, rows.split(keys, squeeze=True), strict=True):
        rng.key = key
    return subs


class BatchKeySequence:
    """KeySequence for B sessions: keys (B, count, 2). A draw of shape (B, ...) gives row i exactly the numbers
    session i's own draw of shape (1, ...) with its own key gives (never a key shared across rows)."""

    def __init__(self, keys: mx.array):
        self._keys = keys
        self._next = 0

    def _draw(self, draw, shape: tuple[int, ...]) -> mx.array:
        if shape[0] != self._keys.shape[0]:
            raise ValueError(f"a batched draw needs one row per session ({self._keys.shape[0]}), got {shape}")
        keys = self._keys[:, self._next]
        self._next += 1
        row = (1, *shape[1:])
        return mx.vmap(lambda key: draw(row, key))(keys).reshape(shape)

    def uniform(self, shape: tuple[int, ...]) -> mx.array:
        return self._draw(lambda row, key: mx.random.uniform(shape=row, key=key), shape)

    def normal(self, shape: tuple[int, ...]) -> mx.array:
        return self._draw(lambda row, key: mx.random.normal(row, key=key), shape)
