"""The codec's short-time Fourier front and back: a periodic Hann window, no centering, float32.

With n_fft 16 and hop 4 (the codec's values), a waveform of N samples is zero-padded by (n_fft - hop) / 2 = 6 at
each end, giving 1 + (N - 4) // 4 frames of 9 bins; `istft` inverts that layout and trims the same 6 samples:

    >>> spec = spectrogram(mx.zeros((1, 1764)), 16, 4)
    >>> spec.shape, spec.dtype
    ((1, 441, 9), mlx.core.complex64)
    >>> istft(spec.real, spec.imag, 16, 4).shape
    (1, 1764)
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx


@lru_cache(maxsize=8)
def hann_window(size: int, periodic: bool = True) -> mx.array:
    """Hann window of `size` float32 taps, computed in float64 then rounded (periodic: denominator `size`)."""
    denominator = size if periodic else size - 1
    taps = [0.5 * (1.0 - math.cos(2.0 * math.pi * n / denominator)) for n in range(size)]
    return mx.array(taps, dtype=mx.float32)


def edge_padding(n_fft: int, hop: int) -> tuple[int, int]:
    """Samples padded before and after the waveform (and trimmed after the inverse): (6, 6) for (16, 4)."""
    left = (n_fft - hop) // 2
    return left, n_fft - hop - left


def _frame_indices(num_frames: int, n_fft: int, hop: int) -> mx.array:
    """(num_frames, n_fft) sample indices of each analysis frame."""
    return mx.arange(num_frames)[:, None] * hop + mx.arange(n_fft)[None, :]


def spectrogram(waveform: mx.array, n_fft: int, hop: int) -> mx.array:
    """waveform: (B, N) -> complex64 (B, frames, n_fft // 2 + 1), frames = 1 + (N + pad - n_fft) // hop."""
    if waveform.ndim != 2:
        raise ValueError(f"waveform must have shape (batch, samples), got {tuple(waveform.shape)}")
    left, right = edge_padding(n_fft, hop)
    padded = mx.pad(waveform.astype(mx.float32), ((0, 0), (left, right)))
    if padded.shape[1] < n_fft:
        padded = mx.pad(padded, ((0, 0), (0, n_fft - padded.shape[1])))
    num_frames = 1 + (padded.shape[1] - n_fft) // hop
    frames = padded[:, _frame_indices(num_frames, n_fft, hop)]
    return mx.fft.rfft(frames * hann_window(n_fft), axis=-1)


def _overlap_add(frames: mx.array, hop: int) -> mx.array:
    """frames: (B, F, L) with L a multiple of hop -> (B, (F - 1) * hop + L), summing each output sample's
    contributions from the earliest frame to the latest (the order a sequential scatter-add uses)."""
    batch, num_frames, length = frames.shape
    parts = length // hop
    blocks = frames.reshape(batch, num_frames, parts, hop)
    total = num_frames - 1 + parts  # output blocks of `hop` samples
    out = mx.zeros((batch, total, hop), dtype=frames.dtype)
    # Frame m adds its part c to output block m + c; the earliest frame for a block holds the highest part.
    for part in reversed(range(parts)):
        shifted = mx.pad(blocks[:, :, part], ((0, 0), (part, parts - 1 - part), (0, 0)))
        out = out + shifted
    return out.reshape(batch, total * hop)


def istft(real: mx.array, imag: mx.array, n_fft: int, hop: int) -> mx.array:
    """real, imag: (B, frames, n_fft // 2 + 1) -> float32 (B, (frames - 1) * hop + n_fft - 2 * 6) samples.

    Each inverse frame is clipped to the +-window envelope before the synthesis window, then overlap-added
    and divided by the summed squared window (floored at 1e-10); the edge padding is trimmed."""
    if n_fft % hop:
        raise ValueError(f"n_fft {n_fft} must be a multiple of the hop {hop}")
    window = hann_window(n_fft)
    spectrum = real + 1j * imag
    frames = mx.fft.irfft(spectrum, n=n_fft, axis=-1)
    frames = mx.clip(frames, -window, window) * window
    num_frames = frames.shape[1]
    summed = _overlap_add(frames, hop)
    norm = _overlap_add(mx.broadcast_to(window * window, (1, num_frames, n_fft)), hop)
    summed = summed / mx.maximum(norm, 1e-10)
    left, right = edge_padding(n_fft, hop)
    return summed[:, left : summed.shape[1] - right]
