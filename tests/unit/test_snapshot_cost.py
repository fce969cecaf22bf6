"""tools.snapshot_cost: its sums from the config equal the bytes of real snapshots' arrays, whole and deltas (the
tiny preset)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from services.codec.engine import CodecEngine
from services.common import cache
from services.common.snapshot import Marks, Slices
from services.llm.engine import LanguageEngine
from services.perception.engine import PerceptionEngine
from services.tts.engine import TTSEngine
from services.tts.prompt import warmup_codes
from tools.snapshot_cost import main, state_bytes

PROMPT, FRAMES, BASE_AT = [1, 5, 6, 2], 6, 2


def array_bytes(session, since: Marks | None = None) -> int:
    state = session.snapshot(since).values()
    return sum(v.nbytes for v in state if isinstance(v, mx.array)) + sum(
        a.nbytes for v in state if isinstance(v, Slices) for _, a in v.runs)


def base(session) -> Marks:
    """The marks of a first (whole) snapshot of `session`, for a delta against it."""
    marks = Marks()
    marks.begin(0)
    session.snapshot(marks)
    marks.end()
    return marks


def delta_bytes(session, marks: Marks) -> int:
    marks.begin(marks.id)
    return array_bytes(session, marks)


@pytest.mark.parametrize("grow", [256, 4], ids=["bf16-prompt-block", "grown-float32"])
def test_the_state_sizes_match_real_sessions(tiny_checkpoint, grow, monkeypatch):
    monkeypatch.setattr(cache, "GROW", grow)  # 4: the bf16 prompt's block grown by a frame's float32 keys
    language, speech = LanguageEngine.load(tiny_checkpoint), TTSEngine.load(tiny_checkpoint)
    perception, codec = PerceptionEngine.load(tiny_checkpoint), CodecEngine.load(tiny_checkpoint)
    want = state_bytes(language.config, FRAMES, len(PROMPT))
    session = language.open_session(prompt_token_ids=PROMPT, prefix_dtype="bfloat16")
    k = speech.config.tts_config.codebook_size
    voice = speech.open_session(0, warmup_codes(np.zeros((speech.prompt_frames + 1, 31), np.int64), k),
                                len(PROMPT) - 1)
    stream, decode = perception.open_stream(), codec.open_stream()
    marks: dict[str, Marks] = {}
    for t in range(FRAMES):
        if t == BASE_AT:
            marks = {"llm": base(session), "tts": base(voice)}
        session.step(mx.zeros((language.hidden_size,), mx.float32))
        voice.step(5)
        stream.push(np.zeros(perception.frame_samples, np.float32))
        decode.decode_frame(t, np.zeros(codec.num_quantizers, np.int32))
    assert want["llm"] == array_bytes(session)
    assert want["tts"] == array_bytes(voice)
    assert want["codec"] == array_bytes(decode)
    since = state_bytes(language.config, FRAMES, len(PROMPT), since=FRAMES - BASE_AT)
    assert since["llm"] == delta_bytes(session, marks["llm"]) < want["llm"]
    assert since["tts"] == delta_bytes(voice, marks["tts"]) < want["tts"]
    for _ in range(20):  # perception's attention caches full (the left context)
        stream.push(np.zeros(perception.frame_samples, np.float32))
    # the mel stream's buffers vary a little from frame to frame: the sum is their longest
    assert 0.85 * want["perception"] <= array_bytes(stream) <= want["perception"]


def test_the_full_model_table(capsys):
    assert main(["--ages", "60", "--prompt-tokens", "200"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    # 60 s = 750 frames: the language model's 146 MB of Mamba state and 16 KB a position, speech's 516 KB
    assert row[:2] == ["60s", "14.58"] and row[3] == "176.67" and row[5] == "508.87"
    # a delta of 10 s (125 frames), of 60 s: the fixed-size states whole, the keys of 125 or 750 frames
    assert row[11:15] == ["228.82", "MB", "571.86", "MB"]
    assert main(["--ages", "3600", "--max-context", "0"]) == 0  # unbounded: speech keeps every frame's keys
    unbounded = capsys.readouterr().out.splitlines()[1].split()
    assert main(["--ages", "3600"]) == 0  # the default bound: the prompt and the last 8192 positions
    bounded = capsys.readouterr().out.splitlines()[1].split()
    assert unbounded[5] == "6652.92" and bounded[5] == "3939.14"  # the global layers: 45,236 keys or 8,428
