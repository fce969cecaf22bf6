"""Log-mel frontend (NeMo's AudioToMelSpectrogramPreprocessor at inference), whole-utterance and streaming.

    x' = preemphasis(x, 0.97); frames = centered STFT (reflect pad n_fft/2, hop 160, 400-in-512 symmetric Hann);
    mel = ln(filters @ |X|^2 + 2^-24)    # no normalization

`log_mel(x)` gives `1 + len(x) // hop` frames; `MelStream` emits the same frames incrementally, each once its
window trails the input edge by `lookahead` samples, keeping only the sample tail the next frames need.
"""

from __future__ import annotations

import math
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
    """y[n] = x[n] - coeff * x[n-1]; y[0] = x[0] unless `previous` (1,) supplies the sample before x."""
    head = x[:1] if previous is None else x[:1] - coeff * previous
    return mx.concatenate([head, x[1:] - coeff * x[:-1]], axis=0)


def _frames_to_log_mel(segment: mx.array, num_frames: int, cfg: PreprocessorConfig) -> mx.array:
    """segment: (≥ (num_frames-1)*hop + n_fft,) preemphasized, padded samples -> (num_frames, n_mels)."""
    frames = mx.as_strided(segment, shape=(num_frames, cfg.n_fft), strides=(cfg.hop_length, 1))
    power = mx.square(mx.abs(mx.fft.rfft(frames * analysis_window(cfg)))).astype(mx.float32)
    mel = mel_filterbank(cfg) @ power.T  # (n_mels, T)
    mel = mx.log(mel + mx.array(cfg.log_zero_guard_value, dtype=mx.float32))
    return mel.T


def _reflect(x: mx.array, left: int, right: int) -> mx.array:
    pieces = [x[1 : left + 1][::-1]] if left else []
    pieces.append(x)
    if right:
        pieces.append(x[-(right + 1) : -1][::-1])
    return mx.concatenate(pieces, axis=0) if len(pieces) > 1 else x


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
        edge = self.total - self.lookahead
        end = edge // cfg.hop_length + 1 if edge >= 0 else 0
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

    def _frames(self, start: int, end: int) -> mx.array:
        """Frames [start, end) from the retained buffer (absolute indices)."""
        cfg = self.cfg
        half = cfg.n_fft // 2
        first = start * cfg.hop_length - half - self.offset  # buffer-relative window start
        last = (end - 1) * cfg.hop_length + half - self.offset  # exclusive window end
        lo, hi = max(first, 0), min(last, self.samples.shape[0])
        raw = self.samples[lo:hi]
        previous = self.samples[lo - 1 : lo] if lo > 0 else None
        seg = preemphasize(raw, cfg.preemph, previous)
        seg = _reflect(seg, max(-first, 0), max(last - self.samples.shape[0], 0))
        need = (end - start - 1) * cfg.hop_length + cfg.n_fft
        if seg.shape[0] < need:
            seg = mx.pad(seg, (0, need - seg.shape[0]))
        return _frames_to_log_mel(seg, end - start, cfg)
