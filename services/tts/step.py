"""One frame of EAR-TTS for S sessions (S >= 1) as compiled pieces cut at each backbone attention.

The frame is the model's `step` for S sessions at once: code embedding and guided fusion, 28 backbone blocks,
the final norm and the masked RVQ refinement. Everything but the attention runs inside
`mx.compile`d pieces, so a frame builds and dispatches 29 compiled calls and 28 attentions instead of every op
of every block. The attention (each session's cache write, then its attention over its own keys) runs between
the pieces, uncompiled, because a cache's key count grows every frame:

    piece 0:   previous codes, text rows, offsets   -> fused input x, block 0's q, k, v
    piece k:   x, attention k-1, offsets            -> x after block k-1, block k's q, k, v
    last:      x, attention L-1, draw keys          -> codes (S, 1, Q) and `finish(codes)`

Rows 2i and 2i + 1 are session i's conditioned and unconditioned (guidance) rows. Offsets are arrays, so one
trace per S serves every frame. The pieces run the ops of the plain path in the same order (`EarTts.step`, whose
backbone batches as `Gemma3Backbone.step_batch`): the codes and caches are those of the plain path, bit for bit.

    step = CompiledStep(model, finish=lambda codes: codes == 0)
    codes, extra = step(previous, text_rows, [caches_0, caches_1], keys)   # previous (S, 1, Q), keys (S, n, 2)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from services.common.cache import FullCache, RingCache, attend_sessions
from services.tts.rng import BatchKeySequence

if TYPE_CHECKING:
    from services.tts.model import EarTts

Caches = list[FullCache | RingCache]


class CompiledStep:
    """`EarTts.step` of S sessions at once as compiled pieces; see the module docstring.

    `finish` maps the codes (S, 1, Q) to one more output computed inside the last piece (the engine's raw and
    clean codes stacked for one host read)."""

    def __init__(self, model: EarTts, finish: Callable[[mx.array], mx.array]):
        self.model = model
        self.layers = model.backbone.layers
        self.finish = finish
        self._first = mx.compile(self._first_piece)
        self._middle = [None] + [mx.compile(functools.partial(self._middle_piece, k))
                                 for k in range(1, len(self.layers))]
        self._last = mx.compile(self._last_piece)

    def _first_piece(self, previous: mx.array, text: mx.array, offsets: mx.array):
        """previous codes (S, 1, Q), text rows (S, 1, D) -> x (2S, 1, D) and block 0's q, k, v."""
        x = self.model.fuse_guided(self.model.embed_codes(previous), text)
        return (x, *self.layers[0].head(x, offsets))

    def _middle_piece(self, k: int, x: mx.array, attended: mx.array, offsets: mx.array):
        x = self.layers[k - 1].tail(x, attended)
        return (x, *self.layers[k].head(x, offsets))

    def _last_piece(self, x: mx.array, attended: mx.array, keys: mx.array):
        model = self.model
        hidden = model.backbone.norm(self.layers[-1].tail(x, attended))
        hidden = mx.concatenate([hidden[0::2], hidden[1::2]], axis=0)  # every cond row, then every uncond row
        codes = model.generate_codes_with(hidden, BatchKeySequence(keys))
        return codes, self.finish(codes)

    def __call__(self, previous: mx.array, text: mx.array, caches: Sequence[Caches], keys: mx.array,
                 stack_up_to: int = 0) -> tuple[mx.array, mx.array]:
        """previous (S, 1, Q) int32, text rows (S, 1, D), each session's caches (advanced by one position),
        keys (S, draws, 2) -> (codes (S, 1, Q) int32, finish(codes)). Caches of at most `stack_up_to` keys
        attend stacked, the others in place (see `services.common.cache.attend_sessions`)."""
        offsets = mx.array(np.repeat([own[0].offset for own in caches], 2).astype(np.int32))
        x, q, k, v = self._first(previous, text, offsets)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attended = attend_sessions(q, k, v, [own[i] for own in caches], layer.self_attn.scale, stack_up_to)
            if i < last:
                x, q, k, v = self._middle[i + 1](x, attended, offsets)
        return self._last(x, attended, keys)
