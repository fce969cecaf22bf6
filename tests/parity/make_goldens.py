"""Run the reference implementation on the tiny checkpoints and store what it produced as goldens.

Run with the reference's own environment (never the project's), from the repository root:

    .ref/bin/python tests/parity/make_goldens.py            # or: make goldens

The checkpoints come from our own `tools/make_checkpoint.py` (pure numpy), so the goldens pin both the
generator and the reference's numbers; `checkpoints.json` records the file hashes they were made from.
Intermediates are captured by wrapping the reference's own objects, and each captured run is checked
against the reference's plain result before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mlx_vlm.models.nemotron_voicechat.session as ref_session  # noqa: E402
from mlx_audio.codec.models.nemotron_voicechat import CausalConv1dCache  # noqa: E402
from mlx_audio.stt.models.nemotron_asr.audio import log_mel_spectrogram  # noqa: E402
from mlx_audio.stt.utils import load_audio  # noqa: E402
from mlx_vlm.utils import load  # noqa: E402

from tests.parity.audio_inputs import cases, wav_bytes  # noqa: E402
from tools.dequantize_checkpoint import dequantize_checkpoint  # noqa: E402
from tools.make_checkpoint import write_checkpoint  # noqa: E402

OUT = ROOT / "tests" / "parity" / "golden"
WAV = ROOT / "examples" / "question.wav"
PROMPT = "Be concise and answer in one sentence."
EXTRA_SECONDS = 3.0
LOGIT_POSITIONS = 8
CHECKPOINT_SEED = 0


def np32(x) -> np.ndarray:
    return np.array(x.astype(mx.float32) if x.dtype != mx.float32 else x)


def save(name: str, arrays: dict, meta: dict) -> None:
    """A compressed .npz whose bytes depend only on the arrays (fixed zip timestamps), so an unchanged refresh
    leaves git with nothing to commit."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    arrays["meta"] = np.array(json.dumps(meta, ensure_ascii=False, sort_keys=True))
    path = OUT / f"{name}.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.ascontiguousarray(value) if value.ndim else value,
                                          allow_pickle=False)
    print(f"{path.name}: {path.stat().st_size / 1024:.0f} KiB", flush=True)


class Delegate:
    """Stands in for a reference object, recording calls and forwarding everything else."""

    def __init__(self, inner, on_call):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_on_call", on_call)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *args, **kwargs):
        out = self._inner(*args, **kwargs)
        self._on_call(args, kwargs, out)
        return out


def offline(model, tok, seed: int, prompt: str | None, wav: Path = WAV) -> tuple[dict, dict]:
    sess = model.create_session(tok)
    plain = sess.generate(str(wav), system_prompt=prompt, extra_decoding_seconds=EXTRA_SECONDS, seed=seed,
                          use_language_cache=True)

    captured: dict = {"logits_text": [], "logits_function": [], "codes": [], "transcript_ids": None}
    stt, tts = model.stt_model, model.tts_model.tts_model
    perception = stt.perception

    def on_perception(args, kwargs, out):
        captured["mel"], captured["embeds"], captured["encoder"] = args[0], out[0], out[2]

    def on_language(args, kwargs, out):
        captured["logits_text"].append(out.text_logits[0, -1])
        captured["logits_function"].append(out.function_logits[0, -1])

    original_step = tts.step

    def recording_step(*args, **kwargs):
        out = original_step(*args, **kwargs)
        captured["codes"].append(out.codes[0, 0])
        return out

    class RecordingTokenizer:
        def __getattr__(self, name):
            return getattr(ref_tokenizer, name)

        def decode(self, tokens, vocabulary, *a, **k):
            captured["transcript_ids"] = list(tokens)
            return ref_tokenizer.decode(tokens, vocabulary, *a, **k)

    ref_tokenizer = ref_session.rnnt_tokenizer
    stt.perception = Delegate(perception, on_perception)
    model.stt_model = Delegate(stt, on_language)
    tts.step = recording_step
    ref_session.rnnt_tokenizer = RecordingTokenizer()
    try:
        result = model.create_session(tok).generate(
            str(wav), system_prompt=prompt, extra_decoding_seconds=EXTRA_SECONDS, seed=seed, use_language_cache=True
        )
    finally:  # assigning a module back drops the stand-in from the instance attributes
        model.stt_model = stt
        stt.perception = perception
        vars(tts).pop("step")
        ref_session.rnnt_tokenizer = ref_tokenizer

    for name in ("text_tokens", "function_tokens", "audio_codes", "audio"):
        if not np.array_equal(np.array(getattr(result, name)), np.array(getattr(plain, name))):
            raise SystemExit(f"captured run differs from the plain run in {name}")

    prompt_ids = []
    if prompt:
        prompt_ids = [model.config.bos_token_id, *tok.encode(prompt, add_special_tokens=False),
                      model.config.eos_token_id]
    p = len(prompt_ids)
    frames = int(result.text_tokens.shape[0])
    embeds = captured["embeds"][0, :frames]
    if prompt_ids:
        prefix = stt.embed_tokens(mx.array([prompt_ids], dtype=mx.int32)).astype(embeds.dtype)[0]
        embeds = mx.concatenate([prefix, embeds], axis=0)
    raw = np.zeros((frames, model.config.tts_config.num_quantizers), dtype=np.int32)
    for t, code in enumerate(captured["codes"], start=1):  # a step at every position from 1, prefix included
        if t >= p:
            raw[t - p] = np.array(code)
    silence = model.tts_model.audio_codec.encode(
        mx.zeros((1, 1, (model.tts_model.audio_prompt_latents.Aria.shape[1] + 1) * 1764), dtype=mx.float32)
    ).transpose(0, 2, 1)[0]
    prompt_codes = sess._tts_prompt()[0][0]
    waveform = load_audio(str(wav), sr=model.config.input_sample_rate)
    waveform = mx.pad(waveform, (0, round(EXTRA_SECONDS * model.config.input_sample_rate)))
    mel = log_mel_spectrogram(waveform, model.config.audio_config.preprocessor)
    if not np.array_equal(np.array(mel), np.array(captured["mel"])):
        raise SystemExit("recomputed log-mel differs from the one the session used")

    arrays = {
        "waveform": np.array(waveform),
        "mel": np32(mel[0]),
        "encoder": np32(captured["encoder"][0, :frames]),
        "audio_embeds": np32(embeds),
        "prompt_ids": np.array(prompt_ids, dtype=np.int32),
        "text_tokens": np.array(result.text_tokens, dtype=np.int32),
        "function_tokens": np.array(result.function_tokens, dtype=np.int32),
        "text_logits": np.stack([np32(x) for x in captured["logits_text"][p : p + LOGIT_POSITIONS]]),
        "function_logits": np.stack([np32(x) for x in captured["logits_function"][p : p + LOGIT_POSITIONS]]),
        "prompt_codes": np.array(prompt_codes, dtype=np.int32),
        "silence_codes": np.array(silence, dtype=np.int32),
        "audio_codes_raw": raw,
        "audio_codes": np.array(result.audio_codes, dtype=np.int32),
        "audio": np32(result.audio),
        "transcript_ids": np.array(captured["transcript_ids"] or [], dtype=np.int32),
    }
    meta = {
        "transcript": result.user_transcript,
        "text": result.text,
        "function_text": sess._decode_text(result.function_tokens),
        "frames": frames,
        "prompt_frames": p,
        "system_prompt": prompt or "",
        "seed": seed,
        "extra_decoding_seconds": EXTRA_SECONDS,
        "sample_rate": result.sample_rate,
        "control_codes": np.array(model.tts_model.control_codes).tolist(),
        "codec_silence_tokens": np.array(model.tts_model.codec_silence_tokens).tolist(),
    }
    return arrays, meta


def slim(arrays: dict, meta: dict) -> tuple[dict, dict]:
    """Embeddings, ids, codes and first logits: enough to pin a variant without another megabyte of floats."""
    keep = ("prompt_ids", "audio_embeds", "text_tokens", "function_tokens", "text_logits", "function_logits",
            "audio_codes_raw", "audio_codes", "prompt_codes", "silence_codes")
    return {k: arrays[k] for k in keep}, meta


def online(model, tok, seed: int, prompt: str | None) -> tuple[dict, dict]:
    sess = model.create_session(tok)
    stream = sess.create_streaming_session(system_prompt=prompt, seed=seed)
    encoder, embeds = [], []
    original = stream._perception_step

    def recording(frame):
        projected, encoded = original(frame)
        embeds.append(projected[0, 0])
        encoder.append(encoded[0, 0])
        return projected, encoded

    stream._perception_step = recording
    waveform = load_audio(str(WAV), sr=model.config.input_sample_rate)
    waveform = np.array(mx.pad(waveform, (0, round(EXTRA_SECONDS * model.config.input_sample_rate))))
    events = []
    frame = stream.frame_samples
    for start in range(0, len(waveform), frame):
        events += stream.push_audio(waveform[start : start + frame])
    events += stream.flush(pad_partial=True)

    p = len(stream._text_tokens) - len(encoder)
    audio = [e for e in events if e.kind == "audio"]
    described = [
        {"kind": e.kind, "frame_index": e.frame_index, "token_id": e.token_id, "delta": e.delta, "text": e.text}
        for e in events
        if e.kind != "audio"
    ]
    texts = {kind: "" for kind in ("assistant_text_delta", "function_delta", "user_transcript_delta")}
    for e in events:
        if e.kind in texts:
            texts[e.kind] = e.text
    arrays = {
        "waveform": waveform,
        "stream_encoder": np.stack([np32(x) for x in encoder]),
        "stream_audio_embeds": np.stack([np32(x) for x in embeds]),
        "text_tokens": np.array(stream._text_tokens[p:], dtype=np.int32),
        "function_tokens": np.array(stream._function_tokens[p:], dtype=np.int32),
        "audio_codes": np.stack([np.array(e.audio_codes, dtype=np.int32) for e in audio]),
        "audio": np.concatenate([np32(e.samples) for e in audio]),
    }
    meta = {
        "events": described,
        "transcript": texts["user_transcript_delta"],
        "text": texts["assistant_text_delta"],
        "function_text": texts["function_delta"],
        "frames": len(audio),
        "prompt_frames": p,
        "system_prompt": prompt or "",
        "seed": seed,
        "push_samples": frame,
    }
    return arrays, meta


def codec_roundtrip(model, frames: int = 6) -> tuple[dict, dict]:
    codec = model.tts_model.audio_codec
    cfg = model.config.codec_config
    rng = np.random.default_rng(1234)
    codes = rng.integers(0, cfg.codebook_size, size=(frames, cfg.num_quantizers)).astype(np.int32)
    whole = codec.decode(mx.array(codes.T[None]))[0, 0]
    cache = CausalConv1dCache()
    pieces = [codec.decode_step(mx.array(codes[t : t + 1].T[None]), cache)[0, 0] for t in range(frames)]
    out = codec.encode(whole[None, None]).transpose(0, 2, 1)[0]
    arrays = {
        "codes_in": codes,
        "decoded": np32(whole),
        "stream_decoded": np.concatenate([np32(x) for x in pieces]),
        "codes_out": np.array(out, dtype=np.int32),
    }
    return arrays, {"frames": frames, "seed": 1234}


def audio_reads(folder: Path) -> tuple[dict, dict]:
    """What the reference's input reader (`load_audio` at 16 kHz) makes of a file of each encoding, rate and
    channel count in `audio_inputs`; meta holds each file's sha256, so the test knows it rebuilt the same bytes."""
    arrays, meta = {}, {}
    for name, (rate, encoding, samples) in cases().items():
        if name.startswith("question"):
            continue
        path = folder / f"{name}.wav"
        path.write_bytes(wav_bytes(rate, encoding, samples))
        arrays[name] = np.array(load_audio(str(path), sr=16_000))
        meta[name] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "rate": rate, "encoding": encoding,
                      "channels": samples.shape[1]}
    return arrays, meta


def layout(model) -> dict:
    """Key -> [shape, dtype, sha256 of the bytes] of every parameter the reference holds after loading."""
    from mlx.utils import tree_flatten

    out = {}
    for key, value in tree_flatten(model.parameters()):
        raw = np.array(value.view(mx.uint16)) if value.dtype == mx.bfloat16 else np.array(value)
        out[key] = [list(value.shape), str(value.dtype).removeprefix("mlx.core."),
                    hashlib.sha256(raw.tobytes()).hexdigest()[:16]]
    return out


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    record = {}
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"": {}, "_4bit": {"bits": 4}, "_mixed": {"mixed_bits": True}}
        for suffix, kwargs in variants.items():
            folder = write_checkpoint(Path(tmp) / f"tiny{suffix}", "tiny", CHECKPOINT_SEED, **kwargs)
            record[f"tiny{suffix}"] = digest(folder)
            model, tok = load(str(folder), strict=True)
            save(f"offline{suffix}", *offline(model, tok, 0, None))
            if suffix:
                save(f"offline_prompt{suffix}", *slim(*offline(model, tok, 0, PROMPT)))
            else:
                save("offline_prompt", *offline(model, tok, 0, PROMPT))
                save("offline_seed7", *offline(model, tok, 7, None))
                save("online", *online(model, tok, 0, None))
                save("online_prompt", *online(model, tok, 0, PROMPT))
                save("codec_roundtrip", *codec_roundtrip(model))
                question = Path(tmp) / "question_44k_stereo.wav"
                question.write_bytes(wav_bytes(*cases()["question_44k_stereo"]))
                arrays, meta = slim(*offline(model, tok, 0, None, question))
                meta["sha256"] = hashlib.sha256(question.read_bytes()).hexdigest()
                save("offline_44k_stereo", arrays, meta)
                save("audio_read", *audio_reads(Path(tmp)))
            (OUT / f"layout{suffix or '_dense'}.json").write_text(json.dumps(layout(model), indent=0) + "\n")
            if suffix == "_4bit":  # the language service's --weights-dtype bfloat16 on this checkpoint
                dense = dequantize_checkpoint(folder, Path(tmp) / "tiny_4bit_bf16")
                dense_model, dense_tok = load(str(dense), strict=True)
                save("offline_4bit_bf16", *slim(*offline(dense_model, dense_tok, 0, None)))
    (OUT / "checkpoints.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
