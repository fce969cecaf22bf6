"""Reading user audio and writing response audio.

Any file soundfile reads (WAV, FLAC, OGG; any rate, any channel count) becomes 16 kHz mono float32;
responses are written as mono PCM16 to a temporary name and renamed when complete, so a failed turn never
leaves a partial file or touches one the user already had.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf


class AudioError(ValueError):
    """An input that is not usable audio, or an output path that cannot be written."""


def resample(samples: np.ndarray, source_hz: int, target_hz: int) -> np.ndarray:
    """Band-limited rational resampling with a Kaiser-windowed sinc (polyphase, zero-phase).

    >>> resample(np.ones(441, np.float32), 44_100, 16_000).shape
    (160,)
    """
    if source_hz == target_hz:
        return samples.astype(np.float32, copy=False)
    g = math.gcd(source_hz, target_hz)
    up, down = target_hz // g, source_hz // g
    cutoff = 0.97 / max(up, down)  # fraction of the upsampled Nyquist band kept
    half = 16 * max(up, down)  # taps on each side, in upsampled samples
    n = np.arange(-half, half + 1)
    taps = (up * cutoff * np.sinc(cutoff * n) * np.kaiser(2 * half + 1, 8.6)).astype(np.float64)
    out_len = math.ceil(len(samples) * up / down)
    out = np.empty(out_len, dtype=np.float64)
    x = samples.astype(np.float64)
    for phase_start in range(0, out_len, 4096):  # bounded memory for long inputs
        idx = np.arange(phase_start, min(out_len, phase_start + 4096))
        pos = idx * down  # output sample position on the upsampled grid
        first = -((half - pos) // up)  # first input index whose upsampled position is within reach
        k = np.arange(0, (2 * half) // up + 2)
        src = first[:, None] + k[None, :]
        offset = src * up - pos[:, None]  # distance in upsampled samples, in [-half, half + up)
        valid = (src >= 0) & (src < len(x)) & (np.abs(offset) <= half)
        weights = np.where(valid, taps[np.clip(offset + half, 0, 2 * half)], 0.0)
        out[idx] = (weights * x[np.clip(src, 0, len(x) - 1)]).sum(axis=1)
    return out.astype(np.float32)


def read_audio(path: str | Path, sample_rate: int = 16_000) -> np.ndarray:
    """The file as mono float32 at `sample_rate` (channels averaged, then resampled)."""
    path = Path(path)
    if not path.exists():
        raise AudioError(f"{path}: no such file")
    if path.is_dir():
        raise AudioError(f"{path}: is a folder, not an audio file")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioError(f"{path}: not a readable audio file ({exc})") from None
    if data.shape[0] == 0:
        raise AudioError(f"{path}: the file holds no audio samples")
    mono = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    if not np.all(np.isfinite(mono)):
        raise AudioError(f"{path}: the audio contains non-finite samples")
    return resample(np.ascontiguousarray(mono), int(rate), sample_rate)


def to_pcm16(samples: np.ndarray, scale: float = 32767.0) -> np.ndarray:
    """round(clip(x, -1, 1) * scale) as int16."""
    return np.round(np.clip(samples, -1.0, 1.0) * scale).astype(np.int16)


def check_writable(path: str | Path, overwrite: bool = True) -> Path:
    """Fail before any work when the output cannot be written (missing folder, a folder in the way)."""
    path = Path(path)
    if path.is_dir():
        raise AudioError(f"{path}: is a folder; give a file name for the output WAV")
    if path.exists() and not overwrite:
        raise AudioError(f"{path}: already exists; remove it or pass another output path")
    if not path.parent.exists():
        raise AudioError(f"{path.parent}: no such folder for the output WAV")
    return path


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int) -> Path:
    """Write mono PCM16 atomically: a temporary file in the same folder, renamed when complete."""
    path = check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        sf.write(tmp, to_pcm16(samples), sample_rate, subtype="PCM_16", format="WAV")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; the answer gets the usual mode
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
