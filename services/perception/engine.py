"""Perception engine: loads the perception + RNNT weights once and serves whole utterances and streams.

    engine = PerceptionEngine.load(model_dir)
    result = engine.encode(waveform)            # offline turn: full-utterance encoder
    stream = engine.open_stream()               # online session: cache-aware streaming encoder
    frame = stream.push(samples_1280)
    frames = engine.push_batch([(stream, samples), (other, samples2)])  # several sessions' frames as one step

No gRPC here; all calls of one engine must come from one thread (MLX evaluation is thread-affine).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from services.common import split_matmul
from services.common.batching import raise_first
from services.common.cache import RowSources, group_by_signature
from services.common.checkpoint import Checkpoint
from services.common.config import VoiceChatConfig
from services.common.device_memory import evaluate
from services.common.layers import Linear, route_split_matmuls, widen
from services.common.loading import AS_STORED, LoadOptions
from services.common.snapshot import Marks, Snapshot, State, numbered
from services.perception.conformer import Conformer, Conv, LayerNorm
from services.perception.mel import MelStream, log_mel, push_stacked
from services.perception.rnnt import (
    RNNT,
    BatchProposal,
    JointNetwork,
    PredictionNetwork,
    RNNTState,
    TextSoFar,
)
from services.perception.streaming import CacheBatch, EncoderStream, begin_stacked, padding_mask, stacked_caches
from services.perception.vocabulary import load_vocabulary, pieces_to_text

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
    so_far: TextSoFar  # the transcript as of this frame, joined when `transcript` is read
    token_ids: list[int]  # every RNNT emission of this frame (special pieces included, blanks not)

    @property
    def transcript(self) -> str:
        return str(self.so_far)

    def __iter__(self):  # (audio_embedding, transcript_delta, transcript), the tuple
        return iter((self.audio_embedding, self.transcript_delta, self.transcript))


def check_waveform(samples: np.ndarray | mx.array, sample_rate_hz: int, expected_rate: int) -> mx.array:
    """Validate a mono float waveform; ValueError names the problem."""
    return mx.array(_checked_samples(samples, sample_rate_hz, expected_rate))


def _checked_samples(samples: np.ndarray | mx.array, sample_rate_hz: int, expected_rate: int) -> np.ndarray:
    """`check_waveform` on the host: the validated waveform as a float32 numpy array."""
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
    return arr.astype(np.float32, copy=False)


class _Step(NamedTuple):
    """Entry i's encoder step, up to its batch: `mel` is the mel to begin the frame with (`layout` given: begun
    with the others of that layout) or the window begun already (`layout` None); `span` the window's encoder
    frames [lo, hi) to run."""

    i: int
    stream: PerceptionStream
    mel: mx.array
    layout: tuple | None
    span: tuple[int, int]

    def signature(self) -> tuple:
        """What the steps of one batch share: the window's shape and the span."""
        shape = self.mel.shape if self.layout is None else (1, self.layout[0] + self.layout[1], self.mel.shape[2])
        return (tuple(shape), *self.span)

    def window(self) -> mx.array:
        """The step's (1, W, n_mels) window, begun now when it was not yet."""
        return self.mel if self.layout is None else self.stream.encoder.begin_frame(self.mel)[0]

    def alone(self) -> StreamFrame:
        """The step run on its own, as `push` runs it."""
        return self.stream.emit([self.stream.encoder.step(self.window(), *self.span)])


class PerceptionEngine:
    """Weights of the perception and RNNT networks; stateless apart from them."""

    def __init__(self, config: VoiceChatConfig, encoder: Conformer, proj: Linear, rnnt: RNNT):
        self.config = config
        self.encoder = encoder
        self.proj = proj
        self.rnnt = rnnt
        self.frame_samples = config.input_frame_samples
        self.sample_rate = config.input_sample_rate
        self._rows = RowSources()
        self._batched_streams: weakref.WeakSet[PerceptionStream] = weakref.WeakSet()
        self._zero_lstm_row = mx.zeros((1, rnnt.prediction.hidden), dtype=mx.float32)

    @classmethod
    def load(cls, model_dir: str | Path, options: LoadOptions = AS_STORED) -> PerceptionEngine:
        """options.float32_weights keeps float32 copies of what the float32 frames convert (see below);
        options.split_matmuls (a CUDA GPU only) has the dense bf16 projections of the encoder, the projection
        and the joint meet their float32 inputs in `split_matmul` instead, their weights left in bf16."""
        model_dir = Path(model_dir)
        options = options.only_stored("perception")
        if options.split_matmuls:
            split_matmul.require()
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
        rnnt = RNNT(prediction, joint, load_vocabulary(config, model_dir), config.rnnt_blank_id, audio.max_symbols)
        if options.split_matmuls:
            route_split_matmuls([encoder, proj, joint], model_dir)
        if options.float32_weights:
            # The encoder, projection and joint always compute in float32 (mel in): keep their matmul, conv and
            # norm weights in float32 rather than have every call convert them (outputs are identical; the
            # converted weights take twice the memory). The LSTM's input may be a bf16 row (an embedding): it
            # keeps its arrays as stored and float32 copies for its float32 inputs.
            mx.eval(widen([encoder, proj, joint], mx.float32, (Linear, Conv, LayerNorm)),
                    [a for layer in prediction.layers for a in layer.keep_float32()])
        del weights
        mx.clear_cache()  # the buffers of the weights joined or converted at load go back to the device
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

    def precompile(self, max_batch: int, steps: int = 2) -> None:
        """Push quiet noise through throwaway streams: `steps` batched pushes at every batch size 1..max_batch
        while their attention caches fill (the padded step), again once they are full (the plain step), then at
        every size from 2 the pushes of streams opened together, their first one included, while their encoder
        windows still grow, so each size's compiled steps are traced (and, on a GPU, their kernels built) before
        a client's frame waits for them. The streams are dropped after."""
        noise = np.random.default_rng(0)
        frame = lambda: (1e-3 * noise.standard_normal(self.frame_samples)).astype(np.float32)  # noqa: E731

        def push(some: list[PerceptionStream]) -> None:
            raise_first(self.push_batch([(stream, frame()) for stream in some]))

        def opened(count: int) -> list[PerceptionStream]:
            """`count` new streams past their first push, taken together as streams opening together take it."""
            streams = [self.open_stream() for _ in range(count)]
            push(streams)
            return streams

        opened(1)  # a stream's first push alone
        streams = opened(max_batch)
        for _ in range(2):  # caches filling, then full
            for size in range(1, max_batch + 1):
                for _ in range(steps):
                    push(streams[:size])
            while not all(stream.encoder.caches_full for stream in streams):
                push(streams)
        for size in range(2, max_batch + 1):  # streams opening together: their young windows batched
            fresh = opened(size)
            while True:  # until the subsampling window's mel cache stops growing
                held = fresh[0].encoder.mel_cache.shape[1]
                push(fresh)
                if fresh[0].encoder.mel_cache.shape[1] == held:
                    break

    def push_batch(
        self, frames: Sequence[tuple[PerceptionStream, mx.array | np.ndarray]]
    ) -> list[StreamFrame | Exception]:
        """`stream.push(frame)` for several sessions as one step; entry i's result is what that push returns,
        or the ValueError it raises (that session's state untouched).

        Sessions whose encoder windows share one shape run the conformer step, the
        projection and the RNNT's first greedy steps as one batched graph with one evaluation; a session whose
        attention caches are still filling joins with its caches padded at the front and the padding masked
        out. Sessions whose every greedy step emitted propose their next ones together, one host read per
        round. Sessions whose mel streams share one buffer layout (all of them, past their first pushes) run
        the log-mel front end as one computation over their stacked sample buffers, and build their encoder
        windows as one array. A batch of one and a session alone with its window shape take the solo path;
        sessions opening together take their first pushes as one batch."""
        results: list[StreamFrame | Exception | None] = [None] * len(frames)
        checked = self._checked(frames, results)
        mels = self._push_mel([stream for _, stream, _ in checked], [samples for _, _, samples in checked])
        steps = [self._begin(i, stream, mel, results) for (i, stream, _), mel in zip(checked, mels, strict=True)]
        steps = [step for step in steps if step is not None]
        groups, solo = group_by_signature(steps, _Step.signature)
        for j in solo:
            results[steps[j].i] = steps[j].alone()
        for members in groups:
            group = [steps[j] for j in members]
            lo, hi = group[0].span
            out = self._step_batch([step.stream for step in group], self._windows(group), lo, hi)
            for step, result in zip(group, out, strict=True):
                results[step.i] = result
        self._batched_streams.update(stream for stream, _ in frames if stream.batchable)
        self._rows.keep({id(a) for s in self._batched_streams for a in s.held_rows()})
        return results  # type: ignore[return-value]

    def _checked(self, frames: Sequence[tuple[PerceptionStream, mx.array | np.ndarray]],
                 results: list) -> list[tuple[int, PerceptionStream, np.ndarray]]:
        """The entries that may join a batch, their samples checked: (i, stream, samples). The others' pushes
        run alone (a batch of one, a first push), or their ValueError, into `results`."""
        streams = [stream for stream, _ in frames]
        if len({id(s) for s in streams}) != len(streams):
            raise ValueError("a stream appears more than once in one batch")
        if any(s.engine is not self for s in streams):
            raise ValueError("every stream of a batch must come from this engine")
        checked = []
        for i, (stream, frame) in enumerate(frames):
            if len(frames) == 1 or not stream.batchable:
                results[i] = _solo(stream, frame)
                continue
            try:
                checked.append((i, stream, stream.check_samples(frame)))
            except ValueError as e:
                results[i] = e
        return checked

    @staticmethod
    def _begin(i: int, stream: PerceptionStream, mel: mx.array, results: list) -> _Step | None:
        """Entry i's encoder step up to its batch; None when the push ran (or failed) alone, its result in
        `results`."""
        if not 0 < mel.shape[1] <= stream.encoder.chunk_mel:  # not one encoder chunk: as push does it
            results[i] = stream.emit(stream.encoder.push(mel))
            return None
        layout = stream.encoder.layout(mel.shape[1])
        if layout is not None:  # begun with the others of its layout
            return _Step(i, stream, mel, layout, (layout[2], layout[3]))
        span = stream.encoder.begin_frame(mel)
        if span is None:
            results[i] = stream.emit([])  # raises, as push would
            return None
        window, lo, hi = span
        return _Step(i, stream, window, None, (lo, hi))

    def _push_mel(self, streams: list[PerceptionStream], samples: list[np.ndarray]) -> list[mx.array]:
        """`stream.mel.push(samples)[None]` of every session: those whose mel buffers share one layout as one
        `push_stacked` over their stacked buffers (kept as rows of one array, so the next frame's stack is no
        copy), the others one by one. Returns each session's (1, k, n_mels)."""
        out: list[mx.array | None] = [None] * len(streams)
        groups, solo = group_by_signature(range(len(streams)), lambda b: streams[b].mel.layout(samples[b].shape[0]))
        for b in solo:
            out[b] = streams[b].mel.push(mx.array(samples[b]))[None]
        for members in groups:
            mels = [streams[b].mel for b in members]
            retained = self._rows.gather([m.samples for m in mels], squeeze=True)
            chunks = mx.array(np.stack([samples[b] for b in members]))
            stacked = push_stacked(mels, chunks, retained, lambda kept: self._rows.split(kept, squeeze=True))
            for b, row in zip(members, self._rows.split(stacked), strict=True):  # gathered again without a copy
                out[b] = row
        return out  # type: ignore[return-value]

    def _windows(self, steps: list[_Step]) -> mx.array:
        """The (B, W, n_mels) encoder window of a step's sessions: one concatenation of their stacked mel caches
        and mels where they share one layout, else each session's begin_frame window, concatenated."""
        layouts = {step.layout for step in steps}
        if len(layouts) == 1 and None not in layouts:
            encoders = [step.stream.encoder for step in steps]
            window, _, _ = begin_stacked(encoders, self._rows.gather([step.mel for step in steps]),
                                         self._rows.gather([e.mel_cache for e in encoders]), self._rows.split)
            return window
        return mx.concatenate([step.window() for step in steps], axis=0)

    def _step_batch(self, streams: list[PerceptionStream], window: mx.array, lo: int, hi: int) -> list[StreamFrame]:
        """window: (B, W, n_mels), row b the mel window of streams[b] (every counter already advanced)."""
        encoders = [s.encoder for s in streams]
        left = self.encoder.cfg.left_context
        held = [e.held for e in encoders]  # frames each session's attention caches hold
        attn, conv = stacked_caches(encoders)  # caches still filling: padded at the front, as the last step left them
        if min(held) == left:
            h, attn, conv = self.encoder.compiled_stream_step(window, lo, hi, attn, conv)
        else:  # the padding masked
            h, attn, conv = self.encoder.compiled_padded_stream_step(window, lo, hi, attn, conv,
                                                                     padding_mask(held, left, hi - lo))
        batch = CacheBatch(attn, conv)  # the sessions' caches stay the batch's arrays: no row is made
        for b, e in enumerate(encoders):
            e.join_batch(batch, b, min(held[b] + hi - lo, left))
        embedding = self.proj(h)  # (B, 1, hidden)
        rnnt = self.rnnt
        proposal = None
        if rnnt.vocabulary:
            proposal = rnnt.begin_batch([s.rnnt for s in streams], h, self._lstm_rows(streams))
        outputs = [(embedding[b, 0], h[b, 0]) for b in range(len(streams))]
        # the batch's one evaluation: every output, every cache and the first greedy RNNT steps together
        evaluate(*(a for pair in outputs for a in pair), *attn, *conv,
                *(a for s in streams for a in (*s.mel.arrays(), s.encoder.mel_cache)),
                *(proposal.arrays() if proposal is not None else ()))
        transcripts = self._finish_batch(streams, proposal) if rnnt.vocabulary else [([], "")] * len(streams)
        results = []
        for stream, (emb, enc_out), (emitted, delta) in zip(streams, outputs, transcripts, strict=True):
            results.append(StreamFrame(stream.frame_index, emb, enc_out, delta, stream.rnnt.so_far(), emitted))
            stream.frame_index += 1
        return results

    def _lstm_rows(self, streams: list[PerceptionStream]) -> tuple[list[mx.array], list[mx.array]]:
        """The sessions' LSTM states as per-layer (h, c) of (B, H); zero rows where a state is None."""
        zero, layers = self._zero_lstm_row, range(len(self.rnnt.prediction.layers))
        return tuple([self._rows.gather([s.rnnt.lstm[part][n] if s.rnnt.lstm else zero for s in streams])
                      for n in layers] for part in range(2))  # type: ignore[return-value]

    def _finish_batch(
        self, streams: list[PerceptionStream], proposal: BatchProposal | None
    ) -> list[tuple[list[int], str]]:
        """`RNNT.finish_transcript` of every session: one host read per round of greedy steps, the sessions
        whose every step emitted proposing their next steps together, each round twice as deep as the last."""
        rnnt = self.rnnt
        before = [len(s.rnnt.token_ids) for s in streams]
        emitted: list[list[int]] = [[] for _ in streams]
        active = list(range(len(streams)))  # row j of `proposal` is streams[active[j]]
        while proposal is not None:
            ids = proposal.ids.tolist()
            states = _ProposedStates(proposal.states, self._rows)
            more = []
            for j, b in enumerate(active):
                left = rnnt.max_symbols - len(emitted[b])  # a row may be proposed more steps than it has left
                if rnnt.accept(streams[b].rnnt, ids[j][:left], states.row(j), emitted[b]):
                    more.append(j)
            if not more:
                break
            built = proposal.ids.shape[1]
            steps = max(rnnt.more_steps(built, rnnt.max_symbols - len(emitted[active[j]])) for j in more)
            enc_proj = proposal.enc_proj if len(more) == len(active) else \
                proposal.enc_proj[mx.array(more, dtype=mx.int32)]
            active = [active[j] for j in more]
            proposal = rnnt.propose_batch([streams[b].rnnt for b in active], enc_proj,
                                          self._lstm_rows([streams[b] for b in active]), steps,
                                          proposal.states[0][0][0].dtype)
            mx.eval(proposal.arrays())
        return [(emitted[b], rnnt.update_text(s.rnnt, before[b])) for b, s in enumerate(streams)]


class _ProposedStates:
    """The LSTM states a round of batched greedy steps leaves, step by step, as each row's own rows: a step's
    states are split into rows when a row first takes them. A row takes the state of its last emitting step only,
    and none when it emits a blank first (most rows of most frames), so at most one step's states a row are split,
    not every step's."""

    def __init__(self, states: list[tuple[list[mx.array], list[mx.array]]], rows: RowSources):
        self._states, self._rows = states, rows
        self._split: dict[int, tuple[list[list[mx.array]], list[list[mx.array]]]] = {}

    def row(self, j: int) -> _RowStates:
        return _RowStates(self, j)

    def __len__(self) -> int:
        return len(self._states)

    def step_rows(self, k: int) -> tuple[list[list[mx.array]], list[list[mx.array]]]:
        """Step k's (h, c) per layer, each split into the batch's rows (once)."""
        if k not in self._split:
            hs, cs = self._states[k]
            self._split[k] = ([self._rows.split(a) for a in hs], [self._rows.split(a) for a in cs])
        return self._split[k]


class _RowStates(Sequence):
    """Row j's states of a round (`RNNT.accept`'s `states`): item k is the (h, c) per layer step k leaves."""

    def __init__(self, round_states: _ProposedStates, j: int):
        self._round, self._j = round_states, j

    def __len__(self) -> int:
        return len(self._round)

    def __getitem__(self, k: int) -> tuple[list[mx.array], list[mx.array]]:
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        hs, cs = self._round.step_rows(k % len(self))
        return [r[self._j] for r in hs], [r[self._j] for r in cs]


def _solo(stream: PerceptionStream, frame: mx.array | np.ndarray) -> StreamFrame | ValueError:
    try:
        return stream.push(frame)
    except ValueError as e:  # a bad frame fails before any state changes
        return e


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

    @property
    def batchable(self) -> bool:
        """Nothing pending: the next push is one encoder step, which can join a batch (its attention caches may
        still be filling, or empty before its first push: the batch pads them)."""
        enc = self.encoder
        if enc.mel_cache is None:  # fresh: its first push begins its window and mel buffer, as the others' do
            return enc.pending is None and not self.mel.total
        return enc.pending is None or enc.pending.shape[1] == 0

    def held_rows(self) -> list[mx.array]:
        """The cache arrays this session holds of its own (the mel sample buffer, the encoder's mel cache, its
        per-layer caches unless they are a batch's row, the LSTM state): what the engine's `RowSources` keep."""
        lstm = self.rnnt.lstm
        return [self.mel.samples, *self.encoder.own_arrays(), *((*lstm[0], *lstm[1]) if lstm else ())]

    def snapshot(self, since: Marks | None = None) -> State:
        """The session's whole state (`services.common.snapshot`): the mel stream's sample tail and counters, the
        encoder's caches (the real rows of caches still filling) and counters, the RNNT decoder's last token, LSTM
        state and transcript so far. Of a fixed size but for that text: whole in a delta too (`since` unused)."""
        mel, enc, rnnt = self.mel, self.encoder, self.rnnt
        state: State = {"frame_index": self.frame_index, "mel.samples": mel.samples, "mel.offset": mel.offset,
                        "mel.total": mel.total, "mel.next_frame": mel.next_frame,
                        "encoder.consumed": enc.consumed, "encoder.emitted": enc.emitted,
                        "rnnt.last_token": rnnt.last_token, "rnnt.token_ids": rnnt.token_ids, "rnnt.text": rnnt.text,
                        "rnnt.held": rnnt.held, "rnnt.last_emitted": rnnt.last_emitted}
        for name in ("mel_cache", "pending"):
            if (a := getattr(enc, name)) is not None:
                state[f"encoder.{name}"] = a
        state.update(numbered("encoder.attn", enc.attn_caches) | numbered("encoder.conv", enc.conv_caches))
        if rnnt.lstm:
            state.update(numbered("rnnt.lstm.h", rnnt.lstm[0]) | numbered("rnnt.lstm.c", rnnt.lstm[1]))
        return state

    @classmethod
    def restored(cls, engine: PerceptionEngine, snapshot: Snapshot) -> PerceptionStream:
        """A stream holding the state `snapshot` gave."""
        stream = cls(engine)
        mel, enc, rnnt = stream.mel, stream.encoder, stream.rnnt
        stream.frame_index = snapshot.int("frame_index")
        mel.samples = snapshot.array("mel.samples")
        mel.offset, mel.total, mel.next_frame = (snapshot.int(f"mel.{n}") for n in ("offset", "total", "next_frame"))
        enc.consumed, enc.emitted = snapshot.int("encoder.consumed"), snapshot.int("encoder.emitted")
        enc.mel_cache = snapshot.optional("encoder.mel_cache", snapshot.array)
        enc.pending = snapshot.optional("encoder.pending", snapshot.array)
        layers = range(len(enc.attn_caches))
        enc.attn_caches = [snapshot.array(f"encoder.attn.{n}") for n in layers]
        enc.conv_caches = [snapshot.array(f"encoder.conv.{n}") for n in layers]
        if snapshot.has("rnnt.lstm.h.0"):
            depth = range(len(engine.rnnt.prediction.layers))
            rnnt.lstm = ([snapshot.array(f"rnnt.lstm.h.{n}") for n in depth],
                         [snapshot.array(f"rnnt.lstm.c.{n}") for n in depth])
        rnnt.last_token, rnnt.last_emitted = snapshot.int("rnnt.last_token"), snapshot.int("rnnt.last_emitted")
        rnnt.token_ids = snapshot.ints("rnnt.token_ids")
        text = snapshot.text("rnnt.text")
        rnnt.deltas, rnnt.held = [text] if text else [], snapshot.text("rnnt.held")
        mx.eval(stream.held_rows(), *([enc.pending] if enc.pending is not None else ()))
        return stream

    def push(self, frame: mx.array | np.ndarray) -> StreamFrame:
        """frame: (1280,) float32 -> this frame's projected embedding, encoder output and transcript delta."""
        samples = self.check_frame(frame)
        mel = self.mel.push(samples)
        return self.emit(self.encoder.push(mel[None]))

    def check_frame(self, frame: mx.array | np.ndarray) -> mx.array:
        """frame: (1280,) float samples -> (1280,) float32; ValueError names what is wrong."""
        return mx.array(self.check_samples(frame))

    def check_samples(self, frame: mx.array | np.ndarray) -> np.ndarray:
        """`check_frame` on the host: the (1280,) float32 numpy samples."""
        n = self.engine.frame_samples
        arr = np.asarray(frame)
        if arr.shape != (n,):
            raise ValueError(f"each stream frame must hold exactly {n} samples (80 ms), got shape {arr.shape}; "
                             "zero-pad a partial last frame")
        return _checked_samples(arr, self.engine.sample_rate, self.engine.sample_rate)

    def emit(self, chunks: list[mx.array]) -> StreamFrame:
        """The rest of a push once the encoder ran: projection, RNNT, the frame's evaluation, the transcript."""
        if len(chunks) != 1 or chunks[0].shape[1] != 1:  # guards the frame alignment invariant
            raise RuntimeError(f"streaming encoder produced {[c.shape for c in chunks]} for one frame")
        encoded = chunks[0]
        embedding, encoder_out = self.engine.proj(encoded)[0, 0], encoded[0, 0]
        rnnt = self.engine.rnnt
        proposal = rnnt.begin_frame(self.rnnt, encoded) if rnnt.vocabulary else None
        # the frame's one evaluation: outputs, every cache and the first greedy RNNT steps together
        evaluate(embedding, encoder_out, *self.mel.arrays(), *self.encoder.arrays(),
                *(proposal.arrays() if proposal is not None else ()))
        emitted, delta = rnnt.finish_transcript(self.rnnt, proposal) if rnnt.vocabulary else ([], "")
        out = StreamFrame(self.frame_index, embedding, encoder_out, delta, self.rnnt.so_far(), emitted)
        self.frame_index += 1
        return out

