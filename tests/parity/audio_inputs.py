"""Input files of every common WAV encoding, built byte for byte the same in the reference's environment and in
ours (numpy and struct only), so the goldens can pin how each is read.

Each case is `name -> (sample rate, encoding, samples (frames, channels) float64 in about [-1, 1])`; `wav_bytes`
encodes it. `question_44k_stereo` is the bundled question at 44.1 kHz in two channels, for a whole turn.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

QUESTION_WAV = Path(__file__).resolve().parents[2] / "examples" / "question.wav"

# encoding -> (WAVE format tag, bits per sample)
ENCODINGS = {"u8": (1, 8), "s16": (1, 16), "s24": (1, 24), "s32": (1, 32), "f32": (3, 32), "f64": (3, 64)}


def _signal(rate: int, seconds: float, channels: int, seed: int, loud: bool = False) -> np.ndarray:
    """A tone, a chirp and some noise per channel; with `loud`, a burst past full scale (floats clip it)."""
    t = np.arange(round(rate * seconds)) / rate
    rng = np.random.default_rng(seed)
    out = []
    for c in range(channels):
        x = 0.5 * np.sin(2 * np.pi * (220 + 110 * c) * t) + 0.3 * np.sin(2 * np.pi * (300 + 1500 * t) * t)
        x += 0.05 * rng.standard_normal(len(t))
        out.append(x)
    x = np.stack(out, axis=1)
    if loud:
        x[len(t) // 3 : len(t) // 3 + 40] *= 1.6
    return x


def _question_44k_stereo() -> np.ndarray:
    """The bundled 16 kHz question linearly interpolated to 44.1 kHz, a quieter noisy copy as the right side."""
    raw = QUESTION_WAV.read_bytes()
    at = raw.index(b"data") + 8
    speech = np.frombuffer(raw[at : at + struct.unpack("<I", raw[at - 4 : at])[0]], "<i2") / 32768.0
    t = np.arange(round(len(speech) * 44_100 / 16_000)) / 44_100
    left = np.interp(t, np.arange(len(speech)) / 16_000, speech)
    right = 0.7 * left + 0.003 * np.random.default_rng(9).standard_normal(len(t))
    return np.stack([left, right], axis=1)


def cases() -> dict[str, tuple[int, str, np.ndarray]]:
    return {
        "mono_44k_s16": (44_100, "s16", _signal(44_100, 2.5, 1, 1)),  # several of the reference's 1 s blocks
        "stereo_48k_s16": (48_000, "s16", _signal(48_000, 0.3, 2, 2)),
        "stereo_16k_s16": (16_000, "s16", _signal(16_000, 0.3, 2, 3)),
        "quad_16k_s16": (16_000, "s16", _signal(16_000, 0.2, 4, 4)),
        "three_16k_s16": (16_000, "s16", _signal(16_000, 0.2, 3, 10)),
        "six_44k_s16": (44_100, "s16", _signal(44_100, 0.2, 6, 11)),
        "mono_8k_u8": (8_000, "u8", _signal(8_000, 0.3, 1, 5)),
        "stereo_32k_s24": (32_000, "s24", _signal(32_000, 0.3, 2, 6)),
        "mono_24k_s32": (24_000, "s32", _signal(24_000, 0.3, 1, 7)),
        "stereo_22k_f32": (22_050, "f32", _signal(22_050, 0.3, 2, 8, loud=True)),
        "mono_11k_f64": (11_025, "f64", _signal(11_025, 0.3, 1, 9, loud=True)),
        "question_44k_stereo": (44_100, "s16", _question_44k_stereo()),
    }


def wav_bytes(rate: int, encoding: str, samples: np.ndarray) -> bytes:
    """A RIFF/WAVE file of `samples` (frames, channels): integers rounded and clipped, floats stored as given."""
    tag, bits = ENCODINGS[encoding]
    frames, channels = samples.shape
    if encoding == "u8":
        body = (np.clip(np.round(samples * 128), -128, 127) + 128).astype(np.uint8).tobytes()
    elif encoding in ("f32", "f64"):
        body = samples.astype("<f4" if bits == 32 else "<f8").tobytes()
    else:
        full = 2 ** (bits - 1)
        ints = np.clip(np.round(samples * full), -full, full - 1).astype("<i4")
        if bits == 24:  # the low three bytes of each little-endian 32-bit integer
            body = ints.reshape(-1, 1).view(np.uint8)[:, :3].tobytes()
        else:
            body = ints.astype(f"<i{bits // 8}").tobytes()
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if tag == 3:  # float files carry a fact chunk: the frame count
        chunks += b"fact" + struct.pack("<II", 4, frames)
    chunks += b"data" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks
