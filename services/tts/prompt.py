"""The speaker-prompt warm-up codes, from the codec's encoding of silence (numpy only, for the orchestrator).

The orchestrator asks the codec service to encode `prompt_samples(frames, 1764)` zero samples, which gives
frames + 1 code frames, and sends `warmup_codes(encoded, codebook_size)` in SpeechOpen.prompt_codes:

    >>> warmup_codes(np.zeros((4, 2), np.int32), 9)
    array([[9, 9],
           [0, 0],
           [9, 9]], dtype=int32)
"""

from __future__ import annotations

import numpy as np


def prompt_samples(frames: int, samples_per_frame: int) -> int:
    """Zero samples to encode for a `frames`-frame prompt: one frame more than the prompt."""
    return (frames + 1) * samples_per_frame


def warmup_codes(encoded: np.ndarray, codebook_size: int) -> np.ndarray:
    """encoded: (frames + 1, Q) codes -> (frames, Q) int32 with the first and last kept frame all-mask.

    The mask value is `codebook_size`; the last frame (the BOS position's feed-back) is what the first step
    sees as its previous code.
    """
    codes = np.array(encoded, dtype=np.int32)
    if codes.ndim != 2 or codes.shape[0] < 3:
        raise ValueError(f"encoded silence must be (frames + 1, Q) with frames >= 2, got {codes.shape}")
    codes[0] = codebook_size
    codes[-2] = codebook_size
    return codes[:-1]
