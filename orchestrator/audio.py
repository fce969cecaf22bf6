"""Reading user audio and writing response audio.

Any file soundfile reads (WAV, FLAC, OGG; any rate, any channel count) becomes 16 kHz mono float32, by the
reference implementation's own arithmetic (16-bit samples, its integer downmix, its resampling filter);
responses are written as mono PCM16 to a temporary name and renamed when complete, so a failed turn never
leaves a partial file or touches one the user already had.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf


class AudioError(ValueError):
    """An input that is not usable audio, or an output path that cannot be written."""


# The low-pass filter of every rate conversion: a Kaiser-windowed sinc reaching ZERO_CROSSINGS zero crossings of
# the output band each side, passing ROLLOFF of it, Kaiser beta BETA (resampy's "kaiser_best" design, which the
# reference implementation resamples its input files with).
ZERO_CROSSINGS = 64
ROLLOFF = 0.9475937167399596
BETA = 14.769656459379492
_BLOCK = 1 << 21  # window elements gathered at once (16 MiB of float64), whatever the length of the input


def ratio(source_hz: int, target_hz: int) -> tuple[int, int]:
    """(up, down): the rate conversion as a reduced fraction, target / source."""
    g = math.gcd(source_hz, target_hz)
    return target_hz // g, source_hz // g


def filter_reach(up: int, down: int) -> int:
    """How far the filter reaches each side of an output sample, in samples of the upsampled grid."""
    return ZERO_CROSSINGS * max(up, down)


@functools.lru_cache(maxsize=8)
def _lowpass(up: int, down: int) -> np.ndarray:
    """The filter's taps on the upsampled grid (2 reach + 1 of them), summing to `up`, read-only."""
    reach = filter_reach(up, down)
    cutoff = ROLLOFF / max(up, down)  # of the upsampled grid's Nyquist band
    n = np.arange(2 * reach + 1) - reach
    taps = cutoff * np.sinc(cutoff * n) * np.kaiser(2 * reach + 1, BETA)
    taps *= up / taps.sum()
    taps.flags.writeable = False
    return taps


def resample(samples: np.ndarray, source_hz: int, target_hz: int) -> np.ndarray:
    """Band-limited rational resampling: `samples` zero-stuffed up by `up`, low-pass filtered (`_lowpass`) and
    kept every `down`-th sample, in float64, rounded to float32 once. Beyond its ends the signal holds its first
    and last sample. ceil(n up / down) samples come out, the first at the first input's instant.

    >>> resample(np.ones(441, np.float32), 44_100, 16_000).shape
    (160,)
    """
    if source_hz == target_hz:
        return samples.astype(np.float32, copy=False)
    up, down = ratio(source_hz, target_hz)
    taps = _lowpass(up, down)
    reach = filter_reach(up, down)
    x = np.asarray(samples, dtype=np.float64).reshape(-1)
    n_out = -(-len(x) * up // down)
    if len(x) == 0:
        return np.zeros(0, np.float32)
    # Output i sits at i * down on the upsampled grid; the inputs k within reach of it weigh taps[reach + i down -
    # k up]. Outputs i and i + up share their weights, their inputs `down` apart: one phase at a time, each a
    # matrix of input windows times the phase's weights.
    margin = reach // up + 1
    padded = np.concatenate([np.full(margin, x[0]), x, np.full(2 * margin + down + 2, x[-1])])
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * margin + 1)
    out = np.empty(n_out, dtype=np.float64)
    for phase in range(min(up, n_out)):
        centre = phase * down
        first = -((reach - centre) // up)  # ceil((centre - reach) / up): the first input within reach
        last = (centre + reach) // up
        weights = np.zeros(2 * margin + 1)
        weights[: last - first + 1] = taps[reach + centre - np.arange(first, last + 1) * up]
        starts = first + margin + np.arange(0, n_out - phase, up) // up * down
        rows = max(1, _BLOCK // len(weights))
        for at in range(0, len(starts), rows):
            out[phase + at * up : phase + (at + rows) * up : up] = windows[starts[at : at + rows]] @ weights
    return out.astype(np.float32)


# Integer PCM subtypes, read as 32-bit integers (libsndfile left-justifies every width to 32 bits).
_INTEGER_PCM = {"PCM_S8", "PCM_U8", "PCM_16", "PCM_24", "PCM_32"}
_FLOAT_PCM = {"FLOAT": np.float32, "DOUBLE": np.float64}


def _int16_samples(path: Path, subtype: str) -> np.ndarray:
    """The file's samples as 16-bit integers (int32, frames x channels), the way the reference's decoder
    (miniaudio) converts them: wider integers keep their top 16 bits, 8-bit ones move up 8 bits, and floats
    x in [-1, 1] (clipped) become floor((x + 1) 32767.5) - 32768, computed in the file's float width. Other
    encodings (ADPCM, A-law, MP3, Vorbis...) are decoded to 16 bits by libsndfile, whose decoders may differ
    from the reference's by a step (an MP3 of the bundled question: at most one 16-bit step)."""
    if subtype in _INTEGER_PCM:
        return sf.read(str(path), dtype="int32", always_2d=True)[0] >> 16
    if subtype in _FLOAT_PCM:
        width = _FLOAT_PCM[subtype]
        data = sf.read(str(path), dtype="float64", always_2d=True)[0].astype(width)
        if not np.all(np.isfinite(data)):
            raise AudioError(f"{path}: the audio contains non-finite samples")
        scaled = (np.clip(data, width(-1), width(1)) + width(1)) * width(32767.5)
        return np.floor(scaled).astype(np.int32) - 32768
    return sf.read(str(path), dtype="int16", always_2d=True)[0].astype(np.int32)


def _mono(data: np.ndarray) -> np.ndarray:
    """16-bit samples (frames, channels) -> (frames,) int16, mixed as the reference's decoder mixes them: the
    channels summed in 32 bits, the sum divided as an unsigned 32-bit number, the low 16 bits kept. For 1, 2, 4
    or 8 channels that is the mean rounded down; for other counts a negative sum comes out as a large positive
    sample, as the reference hears such a file (mix it down to mono or stereo first for a faithful input)."""
    total = data.sum(axis=1, dtype=np.int64) & 0xFFFFFFFF
    return ((total // data.shape[1]) & 0xFFFF).astype(np.uint16).view(np.int16)


def read_audio(path: str | Path, sample_rate: int = 16_000) -> np.ndarray:
    """The file as mono float32 at `sample_rate`, read as the reference implementation reads an input file, so
    a turn on any file sees the samples the reference's would: 16-bit samples (`_int16_samples`), the channels
    mixed in integers (`_mono`), divided by 32768, then resampled (`resample`). For PCM and float WAVs of any
    rate and channel count this equals the reference's input bit for bit."""
    path = Path(path)
    if not path.exists():
        raise AudioError(f"{path}: no such file")
    if path.is_dir():
        raise AudioError(f"{path}: is a folder, not an audio file")
    try:
        info = sf.info(str(path))
        data = _int16_samples(path, info.subtype)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioError(f"{path}: not a readable audio file ({exc})") from None
    if data.shape[0] == 0:
        raise AudioError(f"{path}: the file holds no audio samples")
    mono = _mono(data).astype(np.float32) / np.float32(32768)
    return resample(mono, int(info.samplerate), sample_rate)


def to_pcm16(samples: np.ndarray, scale: float = 32767.0) -> np.ndarray:
    """round(clip(x, -1, 1) * scale) as int16, held within int16. The default scale is the responses' (as the
    reference writes its audio); 32768 inverts the input decoding, int16 / 32768, so PCM16 input sent back as
    PCM16 keeps its every value."""
    return np.clip(np.round(np.clip(samples, -1.0, 1.0) * scale), -32768, 32767).astype(np.int16)


def check_writable(path: str | Path, overwrite: bool = True) -> Path:
    """Fail before any work when the output cannot be written: a missing folder, a folder in the way, the user's
    own file (unless `overwrite`), or a folder that takes no new file (read-only, no permission, full), found by
    creating and removing a temporary file there."""
    path = Path(path)
    if path.is_dir():
        raise AudioError(f"{path}: is a folder; give a file name for the output")
    if path.exists() and not overwrite:
        raise AudioError(f"{path}: already exists; pass --force to overwrite it, or another output path")
    if not path.parent.exists():
        raise AudioError(f"{path.parent}: no such folder for the output")
    try:
        with tempfile.NamedTemporaryFile(prefix=f".{path.name}.", suffix=".probe", dir=path.parent):
            pass
    except OSError as exc:
        raise AudioError(f"{path}: cannot write there ({exc.strerror or exc}); give an output path in a writable "
                         "folder") from None
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
