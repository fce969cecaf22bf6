"""The online session against the reference's streaming session (goldens online*.npz), engines in-process.

Exact: every non-audio event (kind, frame, token id, delta, cumulative text, done), text and function ids and
every audio event's codes; the streamed encoder frames, embeddings and audio within 1e-4 (they come out equal).
With a text window the events' texts, stitched from their starts, are the reference's at every event.
"""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.local import LocalEngines
from orchestrator.session import OnlineSession, transcript_vocabulary
from orchestrator.text import SETTLING_IDS, TextDecoder
from services.common.config import VoiceChatConfig
from tests.conftest import load_golden

PROMPT = "Be concise and answer in one sentence."
CASES = {"online": None, "online_prompt": PROMPT}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    engines = LocalEngines(tiny_checkpoint)
    config = VoiceChatConfig.load(tiny_checkpoint)
    yield engines, config, TextDecoder(tiny_checkpoint, config), transcript_vocabulary(tiny_checkpoint, config)
    engines.close()


def stream(engines, waveform, chunk, *, prompt=None, pipelined=True, seed=0, text_window=None):
    local, config, decoder, vocabulary = engines
    session = OnlineSession(local.clients(), config, decoder, system_prompt=prompt, seed=seed, pipelined=pipelined,
                            record=True, rnnt_vocabulary=vocabulary, text_window=text_window)
    events = []
    for start in range(0, len(waveform), chunk):
        events += session.push_audio(waveform[start : start + chunk])
    events += session.flush(pad_partial=True)
    return session, events


def signature(events):
    return [(e.describe(), None if e.samples is None else e.samples.tobytes(),
             None if e.audio_codes is None else e.audio_codes.tolist()) for e in events]


@pytest.fixture(scope="module")
def runs(engines):
    out = {}
    for name, prompt in CASES.items():
        golden, _ = load_golden(name)
        out[name] = stream(engines, golden["waveform"], 1280, prompt=prompt)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_session_equals_the_reference(runs, name):
    golden, meta = load_golden(name)
    session, events = runs[name]
    assert [e.describe() for e in events if e.kind != "audio"] == meta["events"]
    audio = [e for e in events if e.kind == "audio"]
    assert [e.frame_index for e in audio] == list(range(meta["frames"]))
    records = session.records
    assert np.array_equal([r.text_id for r in records], golden["text_tokens"])
    assert np.array_equal([r.function_id for r in records], golden["function_tokens"])
    assert np.array_equal(np.stack([e.audio_codes for e in audio]), golden["audio_codes"])
    for got, key in ((np.stack([r.encoder_out for r in records]), "stream_encoder"),
                     (np.stack([r.audio_embedding for r in records]), "stream_audio_embeds"),
                     (np.concatenate([e.samples for e in audio]), "audio")):
        assert got.shape == golden[key].shape, key
        assert np.abs(got - golden[key]).max() <= 1e-4, key
    assert session.prompt_positions == meta["prompt_frames"]


@pytest.mark.parametrize("name", list(CASES))
def test_first_frame_equals_the_offline_turn(runs, name):
    offline, _ = load_golden(name.replace("online", "offline"))
    session, events = runs[name]
    first = session.records[0]
    assert (first.text_id, first.function_id) == (offline["text_tokens"][0], offline["function_tokens"][0])
    audio = [e for e in events if e.kind == "audio"]
    if name == "online":  # position 0 runs no speech step: offline leaves zeros, online sends codec silence
        assert not offline["audio_codes"][0].any()
        assert np.array_equal(audio[0].audio_codes, session.info.silence_codes)
        assert np.array_equal(audio[1].audio_codes, offline["audio_codes"][1])
    else:
        assert np.array_equal(audio[0].audio_codes, offline["audio_codes"][0])


def test_push_sizes_and_modes_give_identical_events(engines, runs):
    golden, _ = load_golden("online")
    reference = signature(runs["online"][1])
    for chunk, pipelined in ((1, True), (160, False), (4000, True), (1280, False)):
        _, events = stream(engines, golden["waveform"], chunk, pipelined=pipelined)
        assert signature(events) == reference, (chunk, pipelined)


def test_sessions_back_to_back_do_not_interact(engines, runs):
    golden, _ = load_golden("online")
    other, _ = load_golden("online_prompt")
    _, _ = stream(engines, golden["waveform"][: 1280 * 5], 1280, prompt=PROMPT, seed=3)
    _, events = stream(engines, golden["waveform"], 1280)
    assert signature(events) == signature(runs["online"][1])
    _, seeded = stream(engines, golden["waveform"][: 1280 * 8], 1280, seed=7)
    codes = np.stack([e.audio_codes for e in seeded if e.kind == "audio"])
    assert codes.shape == (8, 31) and not np.array_equal(codes, golden["audio_codes"][:8])  # the seed matters


TEXT_KINDS = ("user_transcript_delta", "assistant_text_delta", "function_delta")


@pytest.mark.parametrize("name", list(CASES))
def test_a_windowed_session_rebuilds_the_reference_texts_from_bounded_events(engines, runs, name):
    golden, meta = load_golden(name)
    window = 20
    _, events = stream(engines, golden["waveform"], 1280, prompt=CASES[name], text_window=window)
    unbounded = runs[name][1]
    decoder = engines[2]
    rebuilt, ids = dict.fromkeys(TEXT_KINDS, ""), {kind: [] for kind in TEXT_KINDS}
    for got, whole in zip(events, unbounded, strict=True):
        assert (got.kind, got.frame_index, got.token_id, got.delta) == (whole.kind, whole.frame_index,
                                                                       whole.token_id, whole.delta)
        if got.kind not in TEXT_KINDS:
            continue
        assert got.text_start <= len(rebuilt[got.kind])
        rebuilt[got.kind] = rebuilt[got.kind][:got.text_start] + got.text
        assert rebuilt[got.kind] == whole.text  # at every event, not only the last
        if len(whole.text) <= window:
            assert got.describe() == whole.describe()
        # the window, or more when the start stays before the text's unsettled tail (fewer than 2 x SETTLING_IDS
        # ids) or, in the transcript, before the frame's delta
        ids[got.kind].append(got.token_id)
        tail = len(got.delta) if got.token_id is None else len(decoder.decode(ids[got.kind][-2 * SETTLING_IDS:]))
        assert len(got.text) <= max(window, tail)
    assert (rebuilt["user_transcript_delta"], rebuilt["assistant_text_delta"], rebuilt["function_delta"]) == (
        meta["transcript"], meta["text"], meta["function_text"])
    assert min(len(meta[key]) for key in ("transcript", "text", "function_text")) > 4 * window  # well past it
    assert sum(e.text_start > 0 for e in events) >= 40


@pytest.mark.parametrize("name", list(CASES))
def test_a_window_longer_than_the_texts_changes_no_event(engines, runs, name):
    golden, meta = load_golden(name)
    _, events = stream(engines, golden["waveform"], 1280, prompt=CASES[name], text_window=10_000)
    assert signature(events) == signature(runs[name][1])
    assert [e.describe() for e in events if e.kind != "audio"] == meta["events"]
