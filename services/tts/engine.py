"""The TTS engine: EAR-TTS weights plus per-session state objects. No gRPC here; all calls on one thread.

    engine = TTSEngine.load(model_dir)
    session = engine.open_session(seed=0, prompt_codes=codes, prefix_steps=0)   # codes: (37, 31) int32
    raw, clean = session.step(text_id)                                          # each (31,) int32
    results = engine.step_batch([(session, text_id), (other, other_id)])        # one forward for both

step_batch returns, per entry, what that session's step returns, or the ValueError it raises (that session
left as it was); every session's caches, key, previous code and step count advance exactly as by step().

The prompt codes are the codec's encoding of (frames + 1) * 1764 zero samples with frames 0 and frames - 1
set to the mask index, last frame dropped; the orchestrator gets them from the codec service.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from services.common import cache as cache_layout
from services.common import split_matmul
from services.common.batching import raise_first
from services.common.cache import (
    FullCache,
    RingCache,
    RowSources,
    context_bound,
    group_by_signature,
    stack_limit,
    take_index,
)
from services.common.checkpoint import Checkpoint
from services.common.config import VoiceChatConfig
from services.common.device_memory import evaluate
from services.common.errors import LimitExceeded
from services.common.kept import kept
from services.common.layers import Linear, route_split_matmuls, widen
from services.common.loading import AS_STORED, DEFAULT_MAX_CONTEXT, LoadOptions
from services.common.snapshot import Marks, Snapshot, State, items
from services.tts.blocks import GemmaRMSNorm
from services.tts.model import EarTts
from services.tts.mog import MoGHead
from services.tts.rng import SessionKey, take_batch
from services.tts.step import CompiledStep
from services.tts.subword import CharTable

# The most pad steps a session may run at open for a system-prompt prefix (one per prompt position after the
# first): the language service's default prompt limit of 1024 tokens needs 1023. Each is a full model step.
DEFAULT_MAX_PREFIX_STEPS = 1024
TEXT_ROWS_KEPT = 4096  # text-id embeddings kept by an engine (each (1, 1, hidden): about 9 MB at the real size)
# speaker-prompt warm-ups kept by an engine, each its caches after the prompt (the full model: 37 frames, its global
# layers' buffers a first block of 256 positions; about 35 MB);
# sessions ask for one prompt (the codec's encoding of silence) unless a client sends its own codes
WARMUPS_KEPT = 4
TTS_PREFIXES = ("tts_model.tts_model.", "tts_model.audio_prompt_latents.", "tts_model.codec_silence_tokens",
                "tts_model._control_codes")


def load_vocabulary(model_dir: Path) -> dict[str, int]:
    """token -> id of the checkpoint's tokenizer.json, added tokens included."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing; the TTS character table is built from the tokenizer vocabulary")
    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


# A batched step's attention, per layer: the sessions whose caches hold at most this many keys attend together
# over their keys copied into one padded array; every longer cache is read in place by an attention of its own.
# On a GPU, dispatch-bound (and for the full model's head_dim of 72 MLX has no fused single-query kernel: an
# attention is ~4 kernels), a session read in place costs ~3 kernels more than stacked (its attention and the
# copy of its output against the copies of its keys and values): 30-60 us at 10-20 us a kernel. Stacking copies
# 18.4 KB a key (2 rows x 16 heads x 72 dims x 4 bytes, keys and values), written and read again: 9-15 ns a key
# at 2.5-4 TB/s. They break even at ~2,000-6,500 keys; this limit sits at the low end, so a step's copies stay
# bounded (16 sessions: at most 0.6 GB a layer) and long conversations read their caches in place.
# On the CPU kernels are cheap and copies slow: every cache is read in place there (`stack_limit`).
STACK_KEYS_GPU = 2048


@dataclass
class TTSEngine:
    config: VoiceChatConfig
    model: EarTts
    table: CharTable
    prompt_latent: mx.array  # (1, P, D)
    silence_codes: mx.array  # (Q,) int32
    control_codes: mx.array  # (3,) int32
    max_prefix_steps: int = DEFAULT_MAX_PREFIX_STEPS
    # global-layer keys a session keeps past its prompt and prefix (LoadOptions.max_context; None or 0: all)
    max_context: int | None = DEFAULT_MAX_CONTEXT
    _text_rows: OrderedDict[int, mx.array] = field(default_factory=OrderedDict, repr=False)
    # (prompt codes, cache bound, growth block) -> the caches a session holds after warming up on those codes (`warmed`)
    _warmups: dict[tuple, list[FullCache | RingCache]] = field(default_factory=dict, repr=False)
    # each session's previous codes and random key are rows of the last batched step's arrays (`RowSources`), so
    # the next step of the same sessions gathers them without a copy per session
    _rows: RowSources = field(default_factory=RowSources, repr=False)
    _stepped: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False)
    # the batched step's attention caches of at most this many keys attend stacked (see STACK_KEYS_GPU)
    stack_up_to: int = field(default_factory=lambda: stack_limit(STACK_KEYS_GPU))

    @classmethod
    def load(cls, model_dir: str | Path, options: LoadOptions = AS_STORED,
             max_prefix_steps: int = DEFAULT_MAX_PREFIX_STEPS) -> TTSEngine:
        """options.float32_weights: see below. options.split_matmuls (a CUDA GPU only) has the dense bf16
        projections of the float32 frame path (backbone, code embedding, audio projection, MoG head) meet their
        float32 inputs in `split_matmul`, their weights left in bf16."""
        options = options.only_stored("speech")
        if options.split_matmuls:
            split_matmul.require()
        checkpoint = Checkpoint(model_dir)
        try:
            config = checkpoint.config
            weights = checkpoint.load(TTS_PREFIXES)
            tts = config.tts_config
            model = EarTts.from_weights(weights, "tts_model.tts_model", tts)
            # These compute in float32 (the character encoder and the text projection run in the table's bf16):
            # with float32_weights their weights and norm scales are kept in float32 rather than converted by
            # every call (identical outputs, twice the memory for them).
            frame_path = [model.backbone, model.embed_code, model.fusion.audio_proj, model.mog_head]
            if options.split_matmuls:
                route_split_matmuls(frame_path, model_dir)
            wide = widen(frame_path, mx.float32, (Linear, GemmaRMSNorm, MoGHead)) if options.float32_weights else []
            latent = weights.get(f"tts_model.audio_prompt_latents.{config.speaker}")
            if latent.ndim != 3 or latent.shape[0] != 1 or latent.shape[2] != tts.hidden_size:
                raise ValueError(f"audio_prompt_latents.{config.speaker} has shape {tuple(latent.shape)}, "
                                 f"expected (1, frames, {tts.hidden_size})")
            engine = cls(
                config=config,
                model=model,
                table=CharTable.from_vocabulary(load_vocabulary(model_dir),
                                                model.embed_subword.embed_tokens.num_embeddings),
                prompt_latent=latent,
                silence_codes=weights.get("tts_model.codec_silence_tokens", (tts.num_quantizers,)).astype(mx.int32),
                control_codes=weights.get("tts_model.control_codes").astype(mx.int32),
                max_prefix_steps=max_prefix_steps,
                max_context=options.max_context,
            )
            mx.eval(weights.arrays, model.code_rows, model.code_starts, model.picked_starts, model.books,
                    model.book_norms, wide)
            del weights
            mx.clear_cache()  # the buffers of the weights joined or converted at load go back to the device
            return engine
        finally:
            checkpoint.close()

    @property
    def prompt_frames(self) -> int:
        return self.prompt_latent.shape[1]

    @property
    def num_quantizers(self) -> int:
        return self.config.tts_config.num_quantizers

    def check_text_id(self, text_id: int) -> None:
        vocab = self.config.text_config.vocab_size
        if not 0 <= text_id < vocab:
            raise ValueError(f"text id {text_id} is outside the text vocabulary [0, {vocab})")

    def clean(self, codes: mx.array) -> mx.array:
        """codes: (..., Q) with every control code replaced by that codebook's silence code."""
        control = (codes[..., None] == self.control_codes).any(axis=-1)
        return mx.where(control, mx.broadcast_to(self.silence_codes, codes.shape), codes)

    def open_session(self, seed: int, prompt_codes: np.ndarray, prefix_steps: int = 0) -> TTSSession:
        """Warm up a new session on the speaker prompt, then run `prefix_steps` pad steps."""
        return TTSSession(self, seed, prompt_codes, prefix_steps)

    def warmed(self, codes: np.ndarray, prefix_steps: int) -> list[FullCache | RingCache]:
        """New caches holding the speaker prompt `codes` (P, Q) int32, bounded for `prefix_steps` more kept
        steps. The warm-up runs once per distinct prompt and is copied after (the same computation, so the same
        bits: it draws no random numbers), so sessions opening together do not each run it."""
        bound = context_bound(codes.shape[0] + prefix_steps, self.max_context)
        def warmed_up() -> list[FullCache | RingCache]:
            caches = self.model.backbone.make_caches(bound)
            self.model.warmup(mx.array(codes)[None], self.prompt_latent, self.config.pad_token_id, self.table, caches)
            mx.eval([a for cache in caches for a in (cache.keys, cache.values)])
            return caches

        key = (codes.tobytes(), codes.shape, bound, cache_layout.GROW)  # what the caches' contents and sizes follow
        return [cache.copy() for cache in kept(self._warmups, key, warmed_up, WARMUPS_KEPT)]

    def check_prefix_steps(self, prefix_steps: int) -> None:
        """ValueError / LimitExceeded unless 0 <= prefix_steps <= max_prefix_steps."""
        if prefix_steps < 0:
            raise ValueError(f"prefix_steps must be >= 0, got {prefix_steps}")
        if prefix_steps > self.max_prefix_steps:
            raise LimitExceeded(f"prefix_steps {prefix_steps} exceeds this service's limit of "
                                f"{self.max_prefix_steps} (--max-prefix-steps)")

    def precompile(self, max_batch: int, steps: int = 2) -> None:
        """Run `steps` batched pad steps at every batch size 1..max_batch on throwaway sessions (prompted with
        silence codes), then one step of some of the last batch's sessions at each size below it (the group of
        caches kept, as when some sessions' frames are not due), then one step of them all with words in place
        of pads (`_words`: the character encoder at every character count, not the pad's alone, and the text rows
        gathered by id, not one row broadcast), then at each size the openings of sessions opening together
        (`_precompile_openings`), so each size's compiled code generation is traced (and, on a GPU, its kernels
        built) before a client's frame waits for it. The sessions are dropped after; the words' text rows are
        kept, as any step's are."""
        silence = np.array(self.silence_codes, dtype=np.int32)
        prompt = np.broadcast_to(silence, (self.prompt_frames, self.num_quantizers)).copy()
        sessions = [self.open_session(seed, prompt) for seed in range(max_batch)]
        pad = self.config.pad_token_id
        for size in range(1, max_batch + 1):
            for _ in range(steps):
                raise_first(self.step_batch([(session, pad) for session in sessions[:size]]))
        for size in range(max_batch - 1, 0, -1):
            raise_first(self.step_batch([(session, pad) for session in sessions[:size]]))
        words = self._words(max(max_batch - 1, 1))
        if words:  # one word twice when there are two sessions or more: rows gathered by id, not one per session
            ids = [words[i % len(words)] for i in range(max_batch)]
            raise_first(self.step_batch(list(zip(sessions, ids, strict=True))))
        del sessions
        for size in range(2, max_batch + 1):
            self._precompile_openings(size, prompt)

    def _precompile_openings(self, size: int, prompt: np.ndarray) -> None:
        """`precompile`'s openings at `size`: `size` sessions fresh from the warm-up step together (their caches
        stacked into a group); then half of them step, and all of them (the half's group and the other half
        stacked together). A group's later steps are the first loop's already. Each set is dropped before the
        next opens."""
        pad = self.config.pad_token_id
        for first in (size, size // 2):
            sessions = [self.open_session(seed, prompt) for seed in range(size)]
            if first < size:
                raise_first(self.step_batch([(session, pad) for session in sessions[:first]]))
            raise_first(self.step_batch([(session, pad) for session in sessions]))

    def _words(self, count: int) -> list[int]:
        """Up to `count` text ids with characters, of as many distinct character counts as the vocabulary has
        (the character encoder's passes are grouped by count), fewest characters first."""
        by_length: dict[int, int] = {}
        vocab = self.config.text_config.vocab_size
        for text_id, chars in sorted(self.table.subword_chars.items()):
            if chars and text_id < vocab and text_id != self.config.eos_token_id:
                by_length.setdefault(len(chars), text_id)
        return [by_length[n] for n in sorted(by_length)][:count]

    def step_batch(self, steps: Sequence[tuple[TTSSession, int]]
                   ) -> list[tuple[np.ndarray, np.ndarray] | Exception]:
        """`session.step(text_id)` for every (session, text_id), the valid ones as one batched forward.

        Entry i of the result is what entry i's step returns ((raw, clean) codes, each (Q,) int32) or the
        ValueError it raises, with that session untouched. One entry, or a session that cannot join (caches
        not created), takes the solo path. Codes equal the solo ones up to the rounding of batched matmuls.
        """
        results: list[tuple[np.ndarray, np.ndarray] | Exception | None] = [None] * len(steps)
        valid: list[int] = []
        seen: set[int] = set()
        for i, (session, text_id) in enumerate(steps):
            try:
                if session.engine is not self:
                    raise ValueError("the session belongs to another engine")
                if id(session) in seen:
                    raise ValueError("a session may step only once per batch")
                seen.add(id(session))
                self.check_text_id(text_id)
            except ValueError as error:
                results[i] = error
                continue
            valid.append(i)
        # in the order the sessions opened, whatever order their steps came in: the same sessions then form the
        # same batch, whose attention caches stay grouped between steps (services.common.cache.LayerGroup)
        groups, solo = group_by_signature(valid, lambda i: () if steps[i][0].can_batch else None,
                                          lambda i: steps[i][0].serial)
        for i in (valid[j] for j in solo):
            results[i] = steps[i][0].step(steps[i][1])  # validated: it does not raise for input
        for members in groups:
            batch = [valid[j] for j in members]
            for i, codes in zip(batch, self._step_together([steps[i] for i in batch]), strict=True):
                results[i] = codes
        return results

    @functools.cached_property
    def _compiled_step(self) -> CompiledStep:
        def raw_and_clean(codes: mx.array) -> mx.array:  # (S, 2, Q): one array, one host read
            return mx.stack([codes[:, 0], self.clean(codes)[:, 0]], axis=1)

        return CompiledStep(self.model, finish=raw_and_clean)

    def text_rows(self, text_ids: Sequence[int]) -> mx.array:
        """The character-aware embedding of each id, (S, 1, D), as `embed_known` of that id alone computes it.

        A row depends on its id alone, so rows are kept (the last `TEXT_ROWS_KEPT` ids used): most frames
        repeat an id (padding while the assistant listens), and their step then runs no character encoder."""
        rows = self._text_rows
        missing = list(dict.fromkeys(i for i in text_ids if i not in rows))
        if missing:
            embedded = self.model.embed_subword.embed_rows(missing, self.table)
            for n, text_id in enumerate(missing):
                rows[text_id] = embedded[n : n + 1]
        for text_id in text_ids:
            rows.move_to_end(text_id)
        distinct = list(dict.fromkeys(text_ids))  # most frames share a few ids (padding while listening)
        picked = [rows[text_id] for text_id in distinct]
        while len(rows) > TEXT_ROWS_KEPT:
            rows.popitem(last=False)
        if len(distinct) == 1:
            return mx.broadcast_to(picked[0], (len(text_ids), *picked[0].shape[1:]))  # a view, no copy
        joined = mx.concatenate(picked, axis=0)  # one copy per distinct id, then one take
        if len(distinct) == len(text_ids):
            return joined
        position = {text_id: n for n, text_id in enumerate(distinct)}
        return joined[take_index(tuple(position[text_id] for text_id in text_ids))]

    def _step_together(self, steps: Sequence[tuple[TTSSession, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The validated steps of distinct sessions as one compiled forward (`CompiledStep`)."""
        sessions = [session for session, _ in steps]
        ids = [int(text_id) for _, text_id in steps]
        eos = self.config.eos_token_id
        previous = self._rows.gather([self.silence_codes[None, None, :] if text_id == eos else session.previous
                                      for session, text_id in zip(sessions, ids, strict=True)])
        keys = take_batch([s.rng for s in sessions], self.model.draws, self._rows)
        codes, both = self._compiled_step(previous, self.text_rows(ids), [s.caches for s in sessions], keys,
                                          self.stack_up_to)
        evaluate(codes, both)
        rows = np.array(both, dtype=np.int32)
        for session, row in zip(sessions, self._rows.split(codes), strict=True):
            session.previous = row
            session.steps += 1
        self._stepped.update(sessions)
        self._rows.keep({id(a) for s in self._stepped for a in (s.previous, s.rng.key)})
        return [(row[0], row[1]) for row in rows]


_SERIALS = itertools.count()


class TTSSession:
    """One stream's state: backbone caches, random key, the code fed back next step."""

    def __init__(self, engine: TTSEngine, seed: int, prompt_codes: np.ndarray, prefix_steps: int):
        q, frames = engine.num_quantizers, engine.prompt_frames
        codes = np.asarray(prompt_codes)
        if codes.shape != (frames, q):
            raise ValueError(f"prompt_codes must have shape ({frames}, {q}), got {codes.shape}")
        if codes.dtype.kind not in "iu":
            raise ValueError(f"prompt_codes must be integer codes, got dtype {codes.dtype}")
        mask = engine.config.tts_config.codebook_size
        if codes.size and (codes.min() < 0 or codes.max() > mask):
            raise ValueError(f"prompt_codes must lie in [0, {mask}] ({mask} = masked), got "
                             f"[{codes.min()}, {codes.max()}]")
        engine.check_prefix_steps(prefix_steps)
        self.engine = engine
        self.serial = next(_SERIALS)  # orders the sessions of a batch
        self.rng = SessionKey(seed)
        # the speaker prompt's and the system prompt's prefix steps' keys are kept for good
        codes = codes.astype(np.int32)
        self.caches: list[FullCache | RingCache] = engine.warmed(codes, prefix_steps)
        self.previous = mx.array(codes[-1:])[None]
        self.steps = 0
        for _ in range(prefix_steps):
            self.step(engine.config.pad_token_id)

    @classmethod
    def restored(cls, engine: TTSEngine, snapshot: Snapshot) -> TTSSession:
        """A session holding the state `snapshot` gave (no warm-up, no prefix steps)."""
        session = cls.__new__(cls)
        session.engine, session.serial = engine, next(_SERIALS)
        session.rng = SessionKey(0)
        session.rng.key = snapshot.array("rng")
        session.caches = engine.model.backbone.make_caches()
        for i, cache in enumerate(session.caches):
            cache.restore(snapshot.scope(f"caches.{i}"))
        session.previous, session.steps = snapshot.array("previous"), snapshot.int("steps")
        q = engine.num_quantizers
        if session.previous.shape != (1, 1, q) or len(session.caches) != len(engine.model.backbone.layers):
            raise ValueError("the snapshot is not of a speech session of this checkpoint")
        mx.eval(session.rng.key, session.previous, [a for c in session.caches for a in (c.keys, c.values)
                                                    if a is not None])
        return session

    def snapshot(self, since: Marks | None = None) -> State:
        """The session's whole state (`services.common.snapshot`): steps taken, its random key, the codes fed back
        next and every layer cache's own rows (`caches.I.*`, read from a group's rows in place); with `since` (a
        delta) only the keys each cache wrote since the base."""
        state: State = {"steps": self.steps, "rng": self.rng.key, "previous": self.previous}
        state.update(items(self.caches, "caches", lambda cache: cache.snapshot(since)))
        return state

    @property
    def can_batch(self) -> bool:
        """Whether every cache exists (warm-up made them), so the step can join a batched forward."""
        return all(cache.buffers() for cache in self.caches)  # (`keys` would make a view of a group's rows)

    def step(self, text_id: int) -> tuple[np.ndarray, np.ndarray]:
        """One timeline position: text id in -> (raw codes, clean codes), each (Q,) int32."""
        self.engine.check_text_id(text_id)
        [codes] = self.engine._step_together([(self, text_id)])
        return codes
