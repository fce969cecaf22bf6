"""Cache-aware streaming encoder state: one per session, holding every cache the conformer needs.

Per push of mel frames it re-runs the causal subsampling stack over a short mel window (the retained mel
cache plus the new frames), keeps the encoder frames not yet emitted, and runs them through the layers with
the per-layer attention cache (the last `left_context` frames' key and value projections: a step projects
its new frames only) and conv cache (last `kernel - 1` GLU outputs). The subsampling window starts at zeros
rather than the true history, which is why the streamed frames drift slightly from the whole-utterance
encoder; the reference streams the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from services.common.cache import stack_rows
from services.perception.conformer import NEG_INF, Conformer, subsampled_length

# Mel frames kept for the subsampling window; covers the causal receptive field of the 8x stride stack.
SUBSAMPLING_MEL_CACHE = 16


def pad_while_filling() -> bool:
    """Whether a stream whose attention caches still fill runs the padded compiled step (on a GPU, where a step
    costs its kernel launches: the compiled one launches far fewer) rather than the plain one (on the CPU, where
    it costs its arithmetic: attending over the padding would be work for nothing)."""
    return mx.default_device().type == mx.gpu


class CacheBatch:
    """The attention and conv caches of the encoders that took one batched step, kept as that step's arrays:
    attention (B, left, 2D) per layer, each row padded at the front while its caches fill, and conv (B, kernel - 1,
    D). The same encoders' next batched step takes these arrays as they are; an encoder's own rows (views) are
    made only when something reads them (a snapshot, a step alone), so a batch that keeps stepping together makes
    no row at all."""

    __slots__ = ("attn", "conv")

    def __init__(self, attn: list[mx.array], conv: list[mx.array]):
        self.attn, self.conv = attn, conv


class EncoderStream:
    """Streaming conformer state; `push(mel)` returns the encoder frames that became available.

    Its attention and conv caches are its own arrays, or its row of a `CacheBatch` after a batched step
    (`join_batch`): reading `attn_caches` then gives views of that row, and assigning them leaves the batch."""

    def __init__(self, encoder: Conformer, chunk_frames: int = 1):
        cfg = encoder.cfg
        self.encoder = encoder
        self.factor = cfg.subsampling_factor
        self.chunk_mel = chunk_frames * self.factor
        self._attn, self._conv = encoder.empty_caches()
        self._batch: CacheBatch | None = None
        self._row = 0  # its row of the batch
        self._held = 0  # in a batch: the real frames of its attention rows (their last; the rest is padding)
        self._views: tuple[list[mx.array], list[mx.array], list[mx.array]] | None = None  # of its row, once read
        self.mel_cache: mx.array | None = None  # (1, n, n_mels)
        # while the caches fill: (cache, the padded row it is the tail of) per layer, from the last padded step
        self._padded: list[tuple[mx.array, mx.array]] | None = None
        self.pending: mx.array | None = None
        self.consumed = 0  # mel frames pushed through the subsampler
        self.emitted = 0  # encoder frames produced

    @property
    def attn_caches(self) -> list[mx.array]:
        """Per layer (1, held, 2D): the key and value projections of the last `held` frames."""
        return self._attn if self._batch is None else self._batch_rows()[0]

    @attn_caches.setter
    def attn_caches(self, caches: list[mx.array]) -> None:
        self._leave_batch()
        self._attn = caches

    @property
    def conv_caches(self) -> list[mx.array]:
        """Per layer (1, kernel - 1, D): the last GLU outputs."""
        return self._conv if self._batch is None else self._batch_rows()[1]

    @conv_caches.setter
    def conv_caches(self, caches: list[mx.array]) -> None:
        self._leave_batch()
        self._conv = caches

    @property
    def held(self) -> int:
        """The frames its attention caches hold (at most the left context)."""
        return self._held if self._batch is not None else self._attn[0].shape[1]

    def join_batch(self, batch: CacheBatch, row: int, held: int) -> None:
        """Its caches are now row `row` of `batch`, of which the last `held` attention frames are real."""
        self._batch, self._row, self._held, self._views, self._padded = batch, row, held, None, None

    def batch_row(self) -> tuple[CacheBatch, int] | None:
        """(its batch, its row there), while its caches are a batch's row."""
        return None if self._batch is None else (self._batch, self._row)

    def _batch_rows(self) -> tuple[list[mx.array], list[mx.array], list[mx.array]]:
        """Views of its row of the batch: (attention caches, conv caches, padded attention rows), made once."""
        if self._views is None:
            b, batch, left = self._row, self._batch, self.encoder.cfg.left_context
            padded = [a[b : b + 1] for a in batch.attn]
            attn = padded if self._held == left else [row[:, left - self._held :] for row in padded]
            self._views = (attn, [c[b : b + 1] for c in batch.conv], padded)
        return self._views

    def _leave_batch(self) -> None:
        """Hold its row's caches as its own arrays (views of the batch's), as a padded step alone leaves them."""
        if self._batch is None:
            return
        attn, conv, padded = self._batch_rows()
        self._attn, self._conv = attn, conv
        self._padded = None if self._held == self.encoder.cfg.left_context else list(zip(attn, padded, strict=True))
        self._batch = self._views = None

    def push(self, mel: mx.array) -> list[mx.array]:
        """mel: (1, k, n_mels) -> list of (1, c, d_model) encoder chunks. The last, possibly short, chunk of
        the push is encoded up to the subsampler's right edge (the caller's frames align with it)."""
        if mel.shape[1]:
            self.pending = mel if self.pending is None else mx.concatenate([self.pending, mel], axis=1)
        out = []
        while self.pending is not None and self.pending.shape[1] > 0:
            take = min(self.chunk_mel, self.pending.shape[1])
            chunk, self.pending = self.pending[:, :take], self.pending[:, take:]
            encoded = self._encode(chunk, to_edge=self.pending.shape[1] == 0)
            if encoded is not None:
                out.append(encoded)
        return out

    def _encode(self, mel: mx.array, to_edge: bool) -> mx.array | None:
        span = self._advance(mel, to_edge)
        if span is None:
            return None
        return self.step(*span)

    def step(self, window: mx.array, lo: int, hi: int) -> mx.array:
        """The encoder step over the window's encoder frames [lo, hi) (a span `begin_frame` returned): updates
        the caches, returns the (1, hi - lo, d_model) frames.

        Compiled once the attention caches hold the full left context. Before that every push has new shapes:
        on a GPU (`pad_while_filling()`) the caches are padded at the front to the full left context and the
        padding masked out, so those pushes run compiled too (one trace, not one per cache length; the same
        numbers); elsewhere they run uncompiled over their real keys only, which costs less arithmetic."""
        encoder = self.encoder
        if self.caches_full or not pad_while_filling():
            step = encoder.compiled_stream_step if self.caches_full else encoder.stream_step
            h, self.attn_caches, self.conv_caches = step(window, lo, hi, self.attn_caches, self.conv_caches)
            self._padded = None
            return h
        left = encoder.cfg.left_context
        held = self.held
        h, padded, self.conv_caches = encoder.compiled_padded_stream_step(
            window, lo, hi, self.padded_caches(), self.conv_caches, padding_mask([held], left, hi - lo))
        self.keep_padded(padded, min(held + hi - lo, left))
        return h

    def padded_caches(self) -> list[mx.array]:
        """The attention caches with zero rows in front up to the full left context: the rows the last padded
        step left (no copy), else padded now (an empty float32 cache: the encoder's kept zeros, the same array
        for every fresh stream)."""
        left = self.encoder.cfg.left_context
        return self.padded_rows() or [
            self.encoder.kept_zeros((1, left, cache.shape[2])) if cache.shape[1] == 0 and cache.dtype == mx.float32
            else front_pad(cache, left) for cache in self.attn_caches]

    def keep_padded(self, rows: list[mx.array], keep: int) -> None:
        """Store a padded step's new caches: rows (1, left, 2D) per layer, of which the last `keep` are real (what
        the unpadded step keeps); the zero rows before them are the padding the next padded step needs."""
        left = self.encoder.cfg.left_context
        self.attn_caches = [row if keep == left else row[:, left - keep :] for row in rows]
        self._padded = None if keep == left else list(zip(self.attn_caches, rows, strict=True))

    def padded_rows(self) -> list[mx.array]:
        """The rows the last padded step left, while the caches are still their tails ([] once the caches are
        full or another step replaced them)."""
        if self._batch is not None:
            return [] if self._held == self.encoder.cfg.left_context else self._batch_rows()[2]
        kept = self._padded
        if kept is None or any(cache is not tail for cache, (tail, _) in zip(self.attn_caches, kept, strict=True)):
            return []
        return [row for _, row in kept]

    @property
    def caches_full(self) -> bool:
        return self.held == self.encoder.cfg.left_context

    def begin_frame(self, mel: mx.array) -> tuple[mx.array, int, int] | None:
        """`push` of one chunk (mel: (1, k, n_mels), k <= chunk_mel, nothing pending) up to the encoder step:
        advances every counter and the mel cache and returns the step's (window, lo, hi), or None when the
        push encodes nothing. The caller runs the step and stores the new caches."""
        if (self.pending is not None and self.pending.shape[1]) or not 0 < mel.shape[1] <= self.chunk_mel:
            raise ValueError(f"begin_frame takes one chunk of at most {self.chunk_mel} mel frames, nothing pending")
        self.pending = mel[:, mel.shape[1] :]  # what push leaves: an empty remainder
        return self._advance(mel, to_edge=True)

    def _advance(self, mel: mx.array, to_edge: bool) -> tuple[mx.array, int, int] | None:
        window = mel if self.mel_cache is None else mx.concatenate([self.mel_cache, mel], axis=1)
        lo, hi, keep = self._plan(mel.shape[1], to_edge)
        base = self.emitted - lo
        self.consumed += mel.shape[1]
        self.mel_cache = window[:, -keep:]
        if hi <= lo:
            self.emitted = base + max(lo, hi)
            return None
        self.emitted = base + hi
        return window, lo, hi

    def _plan(self, k: int, to_edge: bool) -> tuple[int, int, int]:
        """(lo, hi, keep) of pushing k mel frames: the window's encoder frames [lo, hi) to run, the mel frames
        to keep as the next cache."""
        cached = 0 if self.mel_cache is None else self.mel_cache.shape[1]
        subsampled = subsampled_length(cached + k, self.encoder.cfg.subsampling_steps)
        end = self.consumed + k
        base = (self.consumed - cached) // self.factor  # encoder index of the window's first encoder frame
        lo = self.emitted - base
        hi = subsampled if to_edge else end // self.factor - base
        # keep the window start on the subsampling grid
        keep = SUBSAMPLING_MEL_CACHE + (end - SUBSAMPLING_MEL_CACHE) % self.factor
        return lo, hi, keep

    def layout(self, k: int) -> tuple[int, int, int, int, int] | None:
        """What `begin_frame` of k mel frames does in window-relative terms: (cached mel frames, k, lo, hi,
        keep). Streams with equal layouts can begin as one `begin_stacked`; None where begin_frame would not
        take the chunk or encodes nothing."""
        if self.mel_cache is None or (self.pending is not None and self.pending.shape[1]) or \
                not 0 < k <= self.chunk_mel:
            return None
        lo, hi, keep = self._plan(k, to_edge=True)
        return (self.mel_cache.shape[1], k, lo, hi, keep) if hi > lo else None

    def arrays(self) -> list[mx.array]:
        """Every cache array, to evaluate at a frame boundary so graphs do not chain across frames (in a batch,
        the batch's)."""
        caches = (*self._attn, *self._conv) if self._batch is None else (*self._batch.attn, *self._batch.conv)
        return [a for a in (self.mel_cache, *caches) if a is not None]

    def own_arrays(self) -> list[mx.array]:
        """The cache arrays it holds itself (no batch's): the mel cache, and its attention caches, padded rows and
        conv caches unless they are a batch's row."""
        own = [] if self._batch is not None else [*self._attn, *self.padded_rows(), *self._conv]
        return [*((self.mel_cache,) if self.mel_cache is not None else ()), *own]


def stacked_caches(streams: list[EncoderStream]) -> tuple[list[mx.array], list[mx.array]]:
    """The streams' attention caches padded to the full left context (B, left, 2D) and conv caches (B, kernel - 1,
    D) per layer, as one batched step takes them: the arrays of the batch they all are the rows of, in its order,
    as they are; the rows of a run of one batch, a view; else one copy."""
    rows = [s.batch_row() for s in streams]
    first = rows[0]
    if first is not None and len(first[0].attn[0]) == len(rows) and all(
            row is not None and row[0] is first[0] and row[1] == b for b, row in enumerate(rows)):
        return list(first[0].attn), list(first[0].conv)  # the batch's sessions in its order: one check, not a layer's
    padded = [None if row is not None else s.padded_caches() for s, row in zip(streams, rows, strict=True)]
    conv = [None if row is not None else s.conv_caches for s, row in zip(streams, rows, strict=True)]

    def layer(n: int, part: str, own: list) -> mx.array:
        return stack_rows([(getattr(row[0], part)[n], row[1]) if row is not None else (mine[n], 0)
                           for row, mine in zip(rows, own, strict=True)])

    layers = range(len(streams[0].encoder.layers))
    return [layer(n, "attn", padded) for n in layers], [layer(n, "conv", conv) for n in layers]


def front_pad(cache: mx.array, length: int) -> mx.array:
    """cache (1, n, D), n <= length -> (1, length, D) with zero rows in front (itself when n == length)."""
    missing = length - cache.shape[1]
    return cache if missing == 0 else mx.pad(cache, [(0, 0), (missing, 0), (0, 0)])


def padding_mask(held: list[int], left: int, new: int) -> mx.array:
    """(B, 1, 1, left + new) additive key mask: NEG_INF on the front padding of each row whose cache holds
    `held[b]` < left inputs, 0 on its real keys."""
    positions = np.arange(left + new)[None, :]
    padding = positions < (left - np.asarray(held))[:, None]
    return mx.array(np.where(padding, NEG_INF, 0.0).astype(np.float32))[:, None, None, :]


def begin_stacked(
    streams: list[EncoderStream],
    mel: mx.array,
    cached: mx.array | None = None,
    split: Callable[[mx.array], list[mx.array]] | None = None,
) -> tuple[mx.array, int, int]:
    """`streams[b].begin_frame(mel[b:b+1])` for B streams of one `layout`, the windows built as one array.

    mel: (B, k, n_mels); cached: the streams' mel caches stacked (B, c, n_mels) (default: stacked here); split:
    (B, keep, n_mels) -> B rows (1, keep, n_mels), each stream's new mel cache (default: row views). Returns
    the (B, W, n_mels) window and the step's (lo, hi); every stream's counters advance as begin_frame's would."""
    layout = streams[0].layout(mel.shape[1])
    if layout is None or any(s.layout(mel.shape[1]) != layout for s in streams[1:]):
        raise ValueError("begin_stacked takes streams of one layout that each encode a frame")
    _, k, lo, hi, keep = layout
    if cached is None:
        cached = mx.concatenate([s.mel_cache for s in streams], axis=0)
    window = mx.concatenate([cached, mel], axis=1)
    kept = window[:, -keep:]
    rows = split(kept) if split is not None else [kept[b : b + 1] for b in range(kept.shape[0])]
    for stream, row in zip(streams, rows, strict=True):
        stream.pending = row[:, :0]  # what begin_frame leaves: an empty remainder
        stream.mel_cache = row
        stream.consumed += k
        stream.emitted += hi - lo
    return window, lo, hi
