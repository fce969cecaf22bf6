"""The codec engine: checkpoint weights in, numpy arrays out; validates input, owns no gRPC.

    engine = CodecEngine.load("/models/voicechat")
    codes = engine.encode(np.zeros(2 * 1764, np.float32))     # (2, 31) int32
    audio = engine.decode(codes)                                # (3528,) float32
    stream = engine.open_stream()
    chunk = stream.decode_frame(0, codes[0])                    # (1764,) float32
    chunks = engine.decode_batch([(stream, 1, codes[1]), (other, 5, other_codes)])  # one step for both

Every method runs MLX work, so a service calls them on its EngineThread.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from services.codec.codec import PREFIX, Codec, DecodeState
from services.common.batching import raise_first
from services.common.cache import RowSources
from services.common.checkpoint import Checkpoint
from services.common.device_memory import evaluate
from services.common.errors import LimitExceeded
from services.common.kept import kept
from services.common.snapshot import Marks, Snapshot, State

DEFAULT_MAX_FRAMES = 4096  # about 5.5 minutes of audio per unary call


def _check_codes(codes: np.ndarray, shape_name: str, num_quantizers: int, codebook_size: int) -> np.ndarray:
    """Integer codes whose last axis is Q and whose values index a codebook, as int32; else ValueError."""
    codes = np.asarray(codes)
    if codes.dtype.kind not in "iu":
        raise ValueError(f"codes must be integers, got dtype {codes.dtype}")
    if codes.size == 0:
        raise ValueError(f"codes are empty (shape {codes.shape}): send at least one frame of {num_quantizers}")
    if codes.shape[-1] != num_quantizers:
        raise ValueError(
            f"codes must have shape {shape_name} with Q={num_quantizers} codebooks, got shape {codes.shape}"
        )
    low, high = int(codes.min()), int(codes.max())
    if low < 0 or high >= codebook_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"code {bad} is out of range: codes must lie in [0, {codebook_size}) (control and mask codes must "
            "be replaced by silence codes before decoding)"
        )
    return codes.astype(np.int32)


def _context(codec: Codec, state: DecodeState) -> list[mx.array]:
    """A started stream's context in the order `Codec.stream_step` takes it: each decoder block's tail, then
    the spectral real and imaginary frames; each (1, ...)."""
    return [*(state.block_tails[index] for index in codec.decoder_blocks), state.spec_real, state.spec_imag]


PROMPT_CODES_KEPT = 4  # warm-up code arrays kept per process, least recently used dropped first


class CodecEngine:
    """One loaded codec serving whole-sequence encode/decode and any number of decode streams."""

    def __init__(self, codec: Codec, max_frames: int = DEFAULT_MAX_FRAMES):
        self.codec = codec
        self.config = codec.config
        self.max_frames = max_frames
        self._prompt_codes: dict[int, np.ndarray] = {}
        # the streams' contexts are rows of the last batched step's arrays: the next step of the same streams
        # gathers them without a copy
        self._rows = RowSources()
        self._zeros: list[mx.array] | None = None  # a fresh stream's context (`_fresh_context`)

    @classmethod
    def load(cls, model_dir: str | Path, max_frames: int = DEFAULT_MAX_FRAMES) -> CodecEngine:
        """Read only the `tts_model.audio_codec.*` tensors of a checkpoint."""
        checkpoint = Checkpoint(model_dir)
        codec = Codec.from_weights(checkpoint.load([PREFIX]), checkpoint.config.codec_config)
        return cls(codec, max_frames)

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def samples_per_frame(self) -> int:
        return self.codec.samples_per_frame

    @property
    def num_quantizers(self) -> int:
        return self.config.num_quantizers

    @property
    def codebook_size(self) -> int:
        return self.config.codebook_size

    def _check_frames(self, frames: int) -> None:
        if frames > self.max_frames:
            raise LimitExceeded(
                f"{frames} code frames ({frames * self.samples_per_frame} samples) exceed this service's limit of "
                f"{self.max_frames}; split the audio into shorter pieces"
            )

    def encode(self, waveform: np.ndarray) -> np.ndarray:
        """waveform: (N,) float mono at the codec rate -> codes (N // 1764, Q) int32; a trailing partial frame
        is dropped."""
        waveform = np.asarray(waveform)
        if waveform.ndim != 1:
            raise ValueError(f"waveform must be mono with shape (N,), got shape {waveform.shape}")
        if waveform.dtype.kind != "f":
            raise ValueError(f"waveform must be floating point samples, got dtype {waveform.dtype}")
        if waveform.size < self.samples_per_frame:
            raise ValueError(
                f"waveform has {waveform.size} samples; the codec needs at least {self.samples_per_frame} "
                "(one code frame)"
            )
        if not np.isfinite(waveform).all():
            raise ValueError(f"waveform has {int((~np.isfinite(waveform)).sum())} non-finite samples (NaN or inf)")
        self._check_frames(waveform.size // self.samples_per_frame)
        codes = self.codec.encode(mx.array(waveform.astype(np.float32))[None])
        return np.array(codes[0])

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """codes: (T, Q) int -> waveform (T * 1764,) float32."""
        codes = np.asarray(codes)
        if codes.ndim != 2:
            raise ValueError(f"codes must have shape (T, {self.num_quantizers}), got shape {codes.shape}")
        codes = _check_codes(codes, "(T, Q)", self.num_quantizers, self.codebook_size)
        self._check_frames(codes.shape[0])
        return np.array(self.codec.decode(mx.array(codes)[None])[0])

    def encode_prompt_codes(self, frames: int) -> np.ndarray:
        """The TTS warm-up codes: encode (frames + 1) * 1764 zero samples, set frame 0 and frame frames - 1 to
        the mask value (codebook_size) and drop the last frame -> (frames, Q) int32."""
        if frames < 2:
            raise ValueError(f"prompt frames must be at least 2, got {frames}")
        def encoded() -> np.ndarray:
            self._check_frames(frames + 1)
            silence = self.codec.encode(mx.zeros((1, (frames + 1) * self.samples_per_frame), dtype=mx.float32))
            codes = np.array(silence[0])
            codes[[0, frames - 1]] = self.codebook_size
            return codes[:frames]

        # sessions ask for one or two lengths
        return kept(self._prompt_codes, frames, encoded, PROMPT_CODES_KEPT).copy()

    def decode_batch(self, frames: Sequence[tuple[DecodeStream, int, np.ndarray]]) -> list[np.ndarray | Exception]:
        """One frame for each of several streams: entry i is the arguments of `stream.decode_frame(frame_index,
        codes)` and result i what that call returns, or the ValueError it raises (that stream left as it was).

        Two or more streams run `Codec.compiled_stream_step` once over their contexts stacked along the batch
        axis, and each gets its own row back; a fresh stream's context is the zeros its first frame would pad
        with (`_fresh_context`), so streams opening together decode their first frames as one step. A lone
        stream takes the solo path. A stream may appear at most once."""
        results: list[np.ndarray | Exception | None] = [None] * len(frames)
        checked: list[tuple[int, DecodeStream, np.ndarray]] = []
        seen: set[int] = set()
        for i, (stream, frame_index, codes) in enumerate(frames):
            try:
                if id(stream) in seen:
                    raise ValueError("a stream appears twice in one batch: send its next frame in a later batch")
                seen.add(id(stream))
                checked.append((i, stream, stream._checked(frame_index, codes)))
            except (ValueError, LimitExceeded) as error:
                results[i] = error
        if len(checked) == 1:
            i, stream, codes = checked[0]
            results[i] = stream._decode(codes)
        elif checked:
            together = self._decode_together([stream for _, stream, _ in checked], [codes for *_, codes in checked])
            for (i, _, _), samples in zip(checked, together, strict=True):
                results[i] = samples
        return results

    def _fresh_context(self) -> list[mx.array]:
        """A fresh stream's context in `_context` order: the zeros its first frame pads each decoder block and
        the spectral frames with (`decode_step` on an empty `DecodeState`), shaped as a started stream's. Their
        shapes and dtypes are read from a first frame's graph, never evaluated; made once."""
        if self._zeros is None:
            state = DecodeState()
            self.codec.decode_step(mx.zeros((1, 1, self.num_quantizers), mx.int32), state)
            self._zeros = [mx.zeros(a.shape, a.dtype) for a in _context(self.codec, state)]
            mx.eval(self._zeros)
        return self._zeros

    def _decode_together(self, streams: list[DecodeStream], codes: list[np.ndarray]) -> list[np.ndarray]:
        """Started streams' next frames in one compiled step; each stream's state becomes its own row."""
        codec = self.codec
        order, context = self._stack_contexts([stream.state for stream in streams])
        frame = mx.array(np.stack([codes[position] for position in order]))[:, None]  # (B, 1, Q)
        samples, tails, spec = codec.compiled_stream_step(frame, context[:-2], (context[-2], context[-1]))
        rows = list(zip(*(self._rows.split(array) for array in (*tails, *spec)), strict=True))
        evaluate(samples, *tails, *spec)
        host = np.array(samples)
        results: list[np.ndarray | None] = [None] * len(streams)
        for r, position in enumerate(order):
            state = streams[position].state
            state.block_tails = dict(zip(codec.decoder_blocks, rows[r][:-2], strict=True))
            state.spec_real, state.spec_imag = rows[r][-2], rows[r][-1]
            state.frames_decoded += 1
            streams[position].next_frame += 1
            results[position] = host[r]
        self._rows.keep({id(array) for row in rows for array in row})  # the last batch's rows, as before
        return results

    def _stack_contexts(self, states: list[DecodeState]) -> tuple[list[int], list[mx.array]]:
        """The states' contexts stacked along the batch axis, and the position in `states` each row holds.

        Rows of the last batched step that their streams still hold come first, in their old order, and cost
        no copy when they are all back in one piece (a run of them is a view; else one take per array); only
        the other streams' arrays are copied in, one concatenate per array."""
        contexts = [_context(self.codec, state) if state.frames_decoded else self._fresh_context() for state in states]
        order = self._rows.arrange([context[0] for context in contexts])
        return order, [self._rows.gather([contexts[p][k] for p in order]) for k in range(len(contexts[0]))]

    def open_stream(self) -> DecodeStream:
        """A fresh causal decode stream (its state is freed with the object)."""
        return DecodeStream(self)

    def precompile(self, max_batch: int, steps: int = 2) -> None:
        """Decode `steps` batched frames of code 0 at every batch size 1..max_batch on throwaway streams, so
        each size's compiled step is traced (and, on a GPU, its kernels built) before a client's frame waits for
        it. The streams are dropped after, and with them the batch state they left."""
        streams = [self.open_stream() for _ in range(max_batch)]
        codes = np.zeros(self.num_quantizers, np.int32)
        for stream in streams:
            stream.decode_frame(0, codes)
        for size in range(1, max_batch + 1):
            for _ in range(steps):
                raise_first(self.decode_batch([(s, s.next_frame, codes) for s in streams[:size]]))
        self._rows.keep(set())


class DecodeStream:
    """One session's streaming decode: one frame of Q codes in, exactly 1764 samples out, in frame order."""

    def __init__(self, engine: CodecEngine):
        self.engine = engine
        self.state = DecodeState()
        self.next_frame = 0

    def snapshot(self, since: Marks | None = None) -> State:
        """The stream's whole state (`services.common.snapshot`): its frame counters and causal context (each
        decoder block's tail, the spectral frames), the context rows read in place. Of a fixed size: whole in a
        delta too (`since` unused)."""
        state: State = {"next_frame": self.next_frame, "frames_decoded": self.state.frames_decoded}
        state.update({f"tails.{index}": tail for index, tail in self.state.block_tails.items()})
        state.update({name: a for name in ("spec_real", "spec_imag") if (a := getattr(self.state, name)) is not None})
        return state

    @classmethod
    def restored(cls, engine: CodecEngine, snapshot: Snapshot) -> DecodeStream:
        """A stream holding the state `snapshot` gave."""
        stream = cls(engine)
        stream.next_frame = snapshot.int("next_frame")
        state = stream.state
        state.frames_decoded = snapshot.int("frames_decoded")
        if state.frames_decoded:
            state.block_tails = {index: snapshot.array(f"tails.{index}") for index in engine.codec.decoder_blocks}
            state.spec_real, state.spec_imag = snapshot.array("spec_real"), snapshot.array("spec_imag")
        mx.eval(state.arrays())
        return stream

    def decode_frame(self, frame_index: int, codes: np.ndarray) -> np.ndarray:
        """codes: (Q,) int for frame `frame_index` (0, 1, 2, ... in order) -> samples (1764,) float32."""
        return self._decode(self._checked(frame_index, codes))

    def _checked(self, frame_index: int, codes: np.ndarray) -> np.ndarray:
        """The frame's codes as (Q,) int32 if it is this stream's next frame and valid; else ValueError."""
        engine = self.engine
        if frame_index != self.next_frame:
            raise ValueError(f"frame_index {frame_index} is out of order: this stream expects {self.next_frame}")
        codes = np.asarray(codes)
        if codes.ndim != 1:
            raise ValueError(f"a stream frame's codes must have shape ({engine.num_quantizers},), got {codes.shape}")
        return _check_codes(codes, "(Q,)", engine.num_quantizers, engine.codebook_size)

    def _decode(self, codes: np.ndarray) -> np.ndarray:
        """Decode checked (Q,) int32 codes of the next frame alone."""
        codec, state, frame = self.engine.codec, self.state, mx.array(codes)[None, None]
        if state.frames_decoded == 0:  # the first frame creates the context the compiled step carries
            samples = codec.decode_step(frame, state)[0]
        else:
            tails = [state.block_tails[index] for index in codec.decoder_blocks]
            samples, tails, (state.spec_real, state.spec_imag) = codec.compiled_stream_step(
                frame, tails, (state.spec_real, state.spec_imag))
            state.block_tails = dict(zip(codec.decoder_blocks, tails, strict=True))
            state.frames_decoded += 1
            samples = samples[0]
        evaluate(samples, *state.arrays())
        self.next_frame += 1
        return np.array(samples)
