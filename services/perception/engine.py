"""Perception engine: loads the perception + RNNT weights once and serves whole utterances and streams.

    engine = PerceptionEngine.load(model_dir)
    result = engine.encode(waveform)            # offline turn: full-utterance encoder
    stream = engine.open_stream()               # online session: cache-aware streaming encoder
    frame = stream.push(samples_1280)

No gRPC here; all calls of one engine must come from one thread (MLX evaluation is thread-affine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from services.common.checkpoint import Checkpoint
from services.common.config import VoiceChatConfig
from services.common.layers import Linear, widen
from services.perception.conformer import Conformer, Conv
from services.perception.mel import MelStream, log_mel
from services.perception.rnnt import RNNT, JointNetwork, PredictionNetwork, RNNTState, pieces_to_text
from services.perception.streaming import EncoderStream

PREFIXES = ("stt_model.perception.", "stt_model.rnnt_decoder.", "stt_model.rnnt_joint.")


@dataclass
class EncodeResult:
    """One utterance: mel (T, n_mels), encoder_out (F, d_model), audio_embeds (F, hidden), all float32."""

    mel: mx.array
    encoder_out: mx.array
    audio_embeds: mx.array
    transcript: str
    token_ids: list[int]  # the transcript's RNNT ids in emission order (no blanks, no special pieces)

    def __iter__(self):  # (audio_embeds, encoder_out, transcript), the tuple
        return iter((self.audio_embeds, self.encoder_out, self.transcript))


@dataclass
class StreamFrame:
    """One 80 ms frame: audio_embedding (hidden,), encoder_out (d_model,), float32."""

    frame_index: int
    audio_embedding: mx.array
    encoder_out: mx.array
    transcript_delta: str
    transcript: str
    token_ids: list[int]  # every RNNT emission of this frame (special pieces included, blanks not)

    def __iter__(self):  # (audio_embedding, transcript_delta, transcript), the tuple
        return iter((self.audio_embedding, self.transcript_delta, self.transcript))


def _vocabulary(config: VoiceChatConfig, model_dir: Path) -> list[str]:
    if config.rnnt_vocabulary:
        return list(config.rnnt_vocabulary)
    path = model_dir / "rnnt_tokenizer" / "vocab.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if isinstance(data, dict):  # piece -> id
        return [piece for piece, _ in sorted(data.items(), key=lambda kv: kv[1])]
    return list(data)


def check_waveform(samples: np.ndarray | mx.array, sample_rate_hz: int, expected_rate: int) -> mx.array:
    """Validate a mono float waveform; ValueError names the problem."""
    if sample_rate_hz != expected_rate:
        raise ValueError(f"sample rate must be {expected_rate} Hz, got {sample_rate_hz} Hz; resample first")
    arr = np.asarray(samples)
    if arr.ndim != 1:
        raise ValueError(f"waveform must be mono with shape (N,), got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("waveform is empty: send at least one sample")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"waveform must be floating point samples, got {arr.dtype}")
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"waveform has non-finite samples (first at index {bad})")
    return mx.array(arr.astype(np.float32, copy=False))


class PerceptionEngine:
    """Weights of the perception and RNNT networks; stateless apart from them."""

    def __init__(self, config: VoiceChatConfig, encoder: Conformer, proj: Linear, rnnt: RNNT):
        self.config = config
        self.encoder = encoder
        self.proj = proj
        self.rnnt = rnnt
        self.frame_samples = config.input_frame_samples
        self.sample_rate = config.input_sample_rate

    @classmethod
    def load(cls, model_dir: str | Path, float32_weights: bool = False) -> PerceptionEngine:
        model_dir = Path(model_dir)
        checkpoint = Checkpoint(model_dir)
        config = checkpoint.config
        audio = config.audio_config
        try:
            weights = checkpoint.load(PREFIXES)  # copies out of the mapped shards
            mx.eval(list(weights.arrays.values()))  # materialize layout conversions on the loading thread
        finally:
            checkpoint.close()
        encoder = Conformer.from_weights(weights, "stt_model.perception.encoder", audio.encoder)
        proj = Linear.from_weights(weights, "stt_model.perception.proj")
        prediction = PredictionNetwork.from_weights(weights, "stt_model.rnnt_decoder", audio.decoder.pred_rnn_layers,
                                                    audio.decoder.pred_hidden)
        joint = JointNetwork.from_weights(weights, "stt_model.rnnt_joint", audio.joint.activation)
        rnnt = RNNT(prediction, joint, _vocabulary(config, model_dir), config.rnnt_blank_id, audio.max_symbols)
        if float32_weights:
            # The encoder, projection and joint always compute in float32 (mel in): keep their matmul and conv
            # weights in float32 rather than have every call convert them (outputs are identical; the converted
            # weights take twice the memory). The LSTM's input may be a bf16 row: it stays as stored.
            mx.eval(widen([encoder, proj, joint], mx.float32, (Linear, Conv)))
        return cls(config, encoder, proj, rnnt)

    @property
    def embedding_dim(self) -> int:
        return self.proj.out_features

    @property
    def encoder_dim(self) -> int:
        return self.config.audio_config.encoder.d_model

    def min_samples(self) -> int:
        return self.config.audio_config.preprocessor.n_fft // 2 + 1

    def encode(self, waveform: mx.array | np.ndarray, sample_rate_hz: int | None = None) -> EncodeResult:
        """waveform: (N,) float32 at 16 kHz -> mel, full-utterance encoder output, projection, transcript."""
        rate = self.sample_rate if sample_rate_hz is None else sample_rate_hz
        x = check_waveform(np.asarray(waveform), rate, self.sample_rate)
        if x.shape[0] < self.min_samples():
            raise ValueError(f"waveform has {x.shape[0]} samples; at least {self.min_samples()} are needed")
        mel = log_mel(x, self.config.audio_config.preprocessor)
        encoded = self.encoder(mel[None])
        projected = self.proj(encoded)
        mx.eval(mel, encoded, projected)
        state = self.rnnt.new_state()
        # without a vocabulary there is no transcript to make (the reference skips the RNNT then too)
        for t in range(encoded.shape[1] if self.rnnt.vocabulary else 0):
            self.rnnt.decode_frame(state, encoded[:, t : t + 1])
        transcript = pieces_to_text(state.token_ids, self.rnnt.vocabulary)
        out = EncodeResult(mel, encoded[0], projected[0], transcript, list(state.token_ids))
        mx.eval(out.encoder_out, out.audio_embeds)
        return out

    def open_stream(self) -> PerceptionStream:
        return PerceptionStream(self)


class PerceptionStream:
    """One online session: streaming log-mel, streaming encoder and RNNT state; one push per 80 ms frame."""

    def __init__(self, engine: PerceptionEngine):
        self.engine = engine
        self.mel = MelStream(engine.config.audio_config.preprocessor, lookahead=engine.frame_samples)
        self.encoder = EncoderStream(engine.encoder, chunk_frames=1)
        self.rnnt: RNNTState = engine.rnnt.new_state()
        self.frame_index = 0

    @property
    def transcript(self) -> str:
        return self.rnnt.text

    def push(self, frame: mx.array | np.ndarray) -> StreamFrame:
        """frame: (1280,) float32 -> this frame's projected embedding, encoder output and transcript delta."""
        n = self.engine.frame_samples
        arr = np.asarray(frame)
        if arr.shape != (n,):
            raise ValueError(f"each stream frame must hold exactly {n} samples (80 ms), got shape {arr.shape}; "
                             "zero-pad a partial last frame")
        samples = check_waveform(arr, self.engine.sample_rate, self.engine.sample_rate)
        mel = self.mel.push(samples)
        chunks = self.encoder.push(mel[None])
        if len(chunks) != 1 or chunks[0].shape[1] != 1:  # guards the frame alignment invariant
            raise RuntimeError(f"streaming encoder produced {[c.shape for c in chunks]} for one frame")
        encoded = chunks[0]
        embedding, encoder_out = self.engine.proj(encoded)[0, 0], encoded[0, 0]
        rnnt = self.engine.rnnt
        proposal = rnnt.begin_frame(self.rnnt, encoded) if rnnt.vocabulary else None
        # the frame's one evaluation: outputs, every cache and the first greedy RNNT steps together
        mx.eval(embedding, encoder_out, *self.mel.arrays(), *self.encoder.arrays(),
                *(proposal.arrays() if proposal is not None else ()))
        emitted, delta = rnnt.finish_transcript(self.rnnt, proposal) if rnnt.vocabulary else ([], "")
        out = StreamFrame(self.frame_index, embedding, encoder_out, delta, self.rnnt.text, emitted)
        self.frame_index += 1
        return out

