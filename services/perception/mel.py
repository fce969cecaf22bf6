"""Log-mel frontend (NeMo's AudioToMelSpectrogramPreprocessor at inference), whole-utterance and streaming.

    x' = preemphasis(x, 0.97); frames = centered STFT (reflect pad n_fft/2, hop 160, 400-in-512 symmetric Hann);
    mel = ln(filters @ |X|^2 + 2^-24)    # no normalization

`log_mel(x)` gives `1 + len(x) // hop` frames; `MelStream` emits the same frames incrementally, each once its
window trails the input edge by `lookahead` samples, keeping only the sample tail the next frames need.
`push_stacked` pushes several streams whose buffers share one layout (`MelStream.layout`) as one computation
over their stacked (B, n) buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import mlx.core as mx
import numpy as np

from services.common.config import PreprocessorConfig


def frame_count(num_samples: int, cfg: PreprocessorConfig) -> int:
    """Centered STFT frames of a waveform: `frame_count(16000) == 101` at hop 160."""
    return 1 + num_samples // cfg.hop_length


@lru_cache(maxsize=8)
def _window_np(win_length: int, n_fft: int) -> np.ndarray:
    # Symmetric Hann computed in float64 per sample, then zero-padded to n_fft around the centre.
    hann = np.array([0.5 * (1.0 - math.cos(2.0 * math.pi * k / (win_length - 1))) for k in range(win_length)],
                    dtype=np.float32)
    left = (n_fft - win_length) // 2
    return np.pad(hann, (left, n_fft - win_length - left))


def analysis_window(cfg: PreprocessorConfig) -> mx.array:
    """(n_fft,) float32: the symmetric `win_length` Hann window centred in n_fft zeros."""
    return mx.array(_window_np(cfg.win_length, cfg.n_fft))


def _hz_to_slaney(hz: float) -> float:
    # Linear below 1 kHz (200/3 Hz per mel), logarithmic above (27 mels per factor 6.4).
    if hz < 1000.0:
        return hz / (200.0 / 3.0)
    return 15.0 + math.log(hz / 1000.0) / (math.log(6.4) / 27.0)


def _slaney_to_hz(mels: mx.array) -> mx.array:
    step = math.log(6.4) / 27.0
    return mx.where(mels >= 15.0, 1000.0 * mx.exp(step * (mels - 15.0)), (200.0 / 3.0) * mels)


@lru_cache(maxsize=8)
def _filterbank(sample_rate: int, n_fft: int, n_mels: int) -> mx.array:
    bins = n_fft // 2 + 1
    freqs = mx.linspace(0, sample_rate // 2, bins, dtype=mx.float32)
    mel_points = mx.linspace(_hz_to_slaney(0.0), _hz_to_slaney(sample_rate / 2), n_mels + 2, dtype=mx.float32)
    edges = _slaney_to_hz(mel_points)  # (n_mels + 2,) triangle corners in Hz
    widths = edges[1:] - edges[:-1]
    offsets = edges[None, :] - freqs[:, None]  # (bins, n_mels + 2)
    rising = -offsets[:, :-2] / widths[:-1]
    falling = offsets[:, 2:] / widths[1:]
    tri = mx.maximum(mx.zeros_like(rising), mx.minimum(rising, falling))
    tri = tri * (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[None, :]  # Slaney area normalization
    out = tri.moveaxis(0, 1)
    mx.eval(out)
    return out


def mel_filterbank(cfg: PreprocessorConfig) -> mx.array:
    """(n_mels, n_fft // 2 + 1) float32 Slaney-scale, Slaney-normalized triangular filters."""
    return _filterbank(cfg.sample_rate, cfg.n_fft, cfg.features)


def preemphasize(x: mx.array, coeff: float, previous: mx.array | None = None) -> mx.array:
    """y[n] = x[n] - coeff * x[n-1] along the last axis; y[0] = x[0] unless `previous` (..., 1) supplies the
    sample before x."""
    head = x[..., :1] if previous is None else x[..., :1] - coeff * previous
    return mx.concatenate([head, x[..., 1:] - coeff * x[..., :-1]], axis=-1)


def _frames_to_log_mel(segment: mx.array, num_frames: int, cfg: PreprocessorConfig) -> mx.array:
    """segment: (..., ≥ (num_frames-1)*hop + n_fft) preemphasized, padded samples, each row contiguous ->
    (..., num_frames, n_mels)."""
    lead = segment.shape[:-1]
    row_strides = [int(np.prod(segment.shape[i + 1 :])) for i in range(len(lead))]  # row-major, as as_strided sees it
    frames = mx.as_strided(segment, shape=(*lead, num_frames, cfg.n_fft),
                           strides=(*row_strides, cfg.hop_length, 1))
    power = mx.square(mx.abs(mx.fft.rfft(frames * analysis_window(cfg)))).astype(mx.float32)
    mel = mel_filterbank(cfg) @ power.swapaxes(-1, -2)  # (..., n_mels, T)
    mel = mx.log(mel + mx.array(cfg.log_zero_guard_value, dtype=mx.float32))
    return mel.swapaxes(-1, -2)


def _reflect(x: mx.array, left: int, right: int) -> mx.array:
    """Reflect-pad the last axis by `left` and `right` samples (the edge sample not repeated)."""
    pieces = [x[..., 1 : left + 1][..., ::-1]] if left else []
    pieces.append(x)
    if right:
        pieces.append(x[..., -(right + 1) : -1][..., ::-1])
    return mx.concatenate(pieces, axis=-1) if len(pieces) > 1 else x


def _buffer_frames(samples: mx.array, first: int, last: int, num_frames: int, cfg: PreprocessorConfig) -> mx.array:
    """Frames of the raw sample buffer(s) samples (..., L) whose windows span buffer indices [first, last), which
    may reach past either end (reflected there, as the centered STFT pads) -> (..., num_frames, n_mels)."""
    length = samples.shape[-1]
    lo, hi = max(first, 0), min(last, length)
    raw = samples[..., lo:hi]
    previous = samples[..., lo - 1 : lo] if lo > 0 else None
    seg = preemphasize(raw, cfg.preemph, previous)
    seg = _reflect(seg, max(-first, 0), max(last - length, 0))
    need = (num_frames - 1) * cfg.hop_length + cfg.n_fft
    if seg.shape[-1] < need:
        seg = mx.pad(seg, [(0, 0)] * (seg.ndim - 1) + [(0, need - seg.shape[-1])])
    return _frames_to_log_mel(seg, num_frames, cfg)


def log_mel(waveform: mx.array, cfg: PreprocessorConfig) -> mx.array:
    """waveform: (N,) float32 -> (1 + N // hop, n_mels) float32."""
    if waveform.shape[0] <= cfg.n_fft // 2:
        raise ValueError(f"waveform has {waveform.shape[0]} samples; the centered STFT needs more than "
                         f"{cfg.n_fft // 2}")
    x = preemphasize(waveform.astype(mx.float32), cfg.preemph)
    half = cfg.n_fft // 2
    x = _reflect(x, half, half)
    return _frames_to_log_mel(x, frame_count(waveform.shape[0], cfg), cfg)


class MelStream:
    """Per-session streaming log-mel state: the retained sample tail and the next frame to emit.

    Frame t is centred on sample t*hop; it is emitted once `lookahead` samples past its centre have arrived
    (`lookahead >= n_fft/2`), so all frames joined equal `log_mel` of the whole input up to that edge.
    """

    def __init__(self, cfg: PreprocessorConfig, lookahead: int):
        if lookahead < cfg.n_fft // 2:
            raise ValueError(f"lookahead {lookahead} must cover half the STFT window ({cfg.n_fft // 2})")
        self.cfg = cfg
        self.lookahead = lookahead
        self.samples = mx.zeros((0,), dtype=mx.float32)  # raw samples from `offset` on
        self.offset = 0  # absolute index of samples[0]
        self.total = 0
        self.next_frame = 0
        # frames kept behind the next one: its left half window plus the preemphasis sample
        self.keep_frames = math.ceil((cfg.n_fft // 2 + 1) / cfg.hop_length)

    def push(self, chunk: mx.array) -> mx.array:
        """chunk: (n,) float32 -> (k, n_mels) newly complete frames (k may be 0)."""
        cfg = self.cfg
        chunk = chunk.astype(mx.float32)
        self.samples = mx.concatenate([self.samples, chunk]) if self.samples.size else chunk
        self.total += chunk.shape[0]
        end = self._end(self.total)
        if end <= self.next_frame:
            return mx.zeros((0, cfg.features), dtype=mx.float32)
        out = self._frames(self.next_frame, end)
        self.next_frame = end
        keep_from = max(end - self.keep_frames, 0) * cfg.hop_length
        if keep_from > self.offset:
            self.samples = self.samples[keep_from - self.offset :]
            self.offset = keep_from
        return out

    def arrays(self) -> list[mx.array]:
        """The retained samples, to evaluate with the frame's outputs so old chunks are freed."""
        return [self.samples]

    def layout(self, n: int) -> tuple | None:
        """What `push` of n samples does in buffer-relative terms: (retained length, n, the next frame's centre
        in the buffer, frames emitted, samples dropped from the front, config, lookahead). Streams with equal
        layouts can push as one `push_stacked` (fresh streams too: their buffers are empty); None where the push
        emits nothing."""
        end = self._end(self.total + n)
        if end <= self.next_frame:
            return None
        hop = self.cfg.hop_length
        drop = max(max(end - self.keep_frames, 0) * hop - self.offset, 0)
        return (self.samples.shape[0], n, self.next_frame * hop - self.offset, end - self.next_frame, drop,
                id(self.cfg), self.lookahead)

    def _end(self, total: int) -> int:
        """One past the last frame complete once `total` samples have arrived."""
        edge = total - self.lookahead
        return edge // self.cfg.hop_length + 1 if edge >= 0 else 0

    def _frames(self, start: int, end: int) -> mx.array:
        """Frames [start, end) from the retained buffer (absolute indices)."""
        half = self.cfg.n_fft // 2
        first = start * self.cfg.hop_length - half - self.offset  # buffer-relative window start
        last = (end - 1) * self.cfg.hop_length + half - self.offset  # exclusive window end
        return _buffer_frames(self.samples, first, last, end - start, self.cfg)


def push_stacked(
    streams: list[MelStream],
    chunks: mx.array,
    retained: mx.array | None = None,
    split: Callable[[mx.array], list[mx.array]] | None = None,
) -> mx.array:
    """`streams[b].push(chunks[b])` for B streams of one `layout`, as one computation over their stacked buffers.

    chunks: (B, n) float32; retained: the streams' sample buffers stacked (B, L) (default: stacked here);
    split: (B, L') -> B rows (L',), each stream's new buffer (default: row views). Returns (B, k, n_mels), row b
    what stream b's own push returns; every stream's counters advance as its push would advance them."""
    layout = streams[0].layout(chunks.shape[-1])
    if layout is None or any(s.layout(chunks.shape[-1]) != layout for s in streams[1:]):
        raise ValueError("push_stacked takes streams of one layout that each emit frames")
    _, n, centre, count, drop, _, _ = layout
    cfg = streams[0].cfg
    if retained is None:
        retained = mx.stack([s.samples for s in streams])
    chunks = chunks.astype(mx.float32)
    buffer = mx.concatenate([retained, chunks], axis=-1) if retained.shape[-1] else chunks  # fresh: chunks alone
    half = cfg.n_fft // 2
    out = _buffer_frames(buffer, centre - half, centre + (count - 1) * cfg.hop_length + half, count, cfg)
    kept = buffer[:, drop:] if drop else buffer
    rows = split(kept) if split is not None else [kept[b : b + 1].squeeze(0) for b in range(kept.shape[0])]
    for stream, row in zip(streams, rows, strict=True):
        stream.samples = row
        stream.total += n
        stream.next_frame += count
        stream.offset += drop
    return out
