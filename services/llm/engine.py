"""The language engine: Nemotron-H weights, the tokenizer, and per-session timelines. No gRPC here.

    engine = LanguageEngine.load("/path/to/checkpoint")
    session = engine.open_session(system_prompt="Be concise.")   # prefills [bos] + prompt + [eos]
    out = session.step(audio)            # audio: (hidden,) float32 -> StepOutput(text_id, function_id, ...)
    engine.close_session(session)

All calls must come from one thread (the service's EngineThread): MLX evaluation is tied to its thread.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from services.common import cache as cache_layout
from services.common import layers, split_matmul
from services.common.batching import raise_first
from services.common.cache import (
    STACK_ALL,
    FullCache,
    Gathered,
    LayerGroup,
    MambaCache,
    StatePools,
    context_bound,
    group_by_signature,
    stack_limit,
)
from services.common.checkpoint import Checkpoint
from services.common.config import VoiceChatConfig
from services.common.device_memory import evaluate
from services.common.errors import LimitExceeded
from services.common.kept import kept
from services.common.layers import Linear, widen
from services.common.loading import AS_STORED, DEFAULT_MAX_CONTEXT, LoadOptions
from services.common.snapshot import Marks, Snapshot, State, items
from services.llm.nemotron_h import (
    WEIGHT_PREFIXES,
    Block,
    DuplexLanguageModel,
    LayerCache,
    Mamba2Mixer,
    NemotronH,
)

MAX_PROMPT_TOKENS = 1024  # system prompt ids, bos and eos included
MAX_FULL_HISTORY_POSITIONS = 4096  # the diagnostic mode recomputes everything each step: keep it bounded
PREFIX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
# A batch of at least this share of a pool's sessions (the others' frames not due) runs over all of the pool's
# rows (`StatePools`), the others' states passed through as they are: its matmuls read the weights once at 15 rows
# as at 16, while taking 15 sessions' rows of the stacked states and writing them back copies every state twice
# (on an H200, 15 of 16 sessions took 54.8 ms a step that way against 36.4 ms for all 16). A smaller share takes
# its rows, so that a step of two of sixteen costs a step of two.
MASKED_SHARE = 0.5
# Sessions opening with a prompt seen lately take copies of the caches it left (`LanguageEngine._take_prompted`): the
# last this many prompts' (on the full model about 140 MB each, nearly all of it the Mamba states).
PROMPTS_KEPT = 4


@dataclass
class StepOutput:
    """One timeline position: greedy ids and, when asked for, both heads' logits (vocab,) float32."""

    text_id: int
    function_id: int
    text_logits: mx.array | None = None
    function_logits: mx.array | None = None


@dataclass
class LanguageSession:
    """One conversation: the previous tokens and either the layer caches or the fused-input history."""

    session_id: int
    model: DuplexLanguageModel
    full_history: bool
    caches: list[LayerCache] = field(default_factory=list)
    history: list[mx.array] = field(default_factory=list)
    prev_text: int = 0  # pad at position 0: set by open_session
    prev_function: int = 0
    positions: int = 0  # timeline positions run so far, prefix included
    prompt_positions: int = 0
    frames: int = 0  # audio frames stepped (positions after the prefix)
    prompt_embeds: mx.array | None = None  # (P, D) the prefix rows as they entered the audio channel
    closed: bool = False
    forced_function: int | None = None  # the next step's function token in place of the head's pick (force_function)
    prompt_key: tuple | None = None  # what its prompt's caches follow (`LanguageEngine._keep_prompted`); None: none
    _dtypes: tuple | None = field(default=None, repr=False)  # ((positions, prompt_positions), cache_dtypes()) read then

    def _run(self, audio: mx.array, want_heads: bool) -> tuple[mx.array, mx.array, mx.array] | None:
        """audio: (1, 1, D) -> both heads' logits at this position, (vocab,) each, and the greedy ids (2,),
        all evaluated; None when the heads are not wanted. One host synchronisation."""
        if self.full_history:
            # Recompute over every fused input so far, heads over the whole sequence, as the reference does.
            self.history.append(self.model.fuse(self.prev_text, audio, self.prev_function))
            hidden = self.model.backbone(mx.concatenate(self.history, axis=1))
            text_logits, function_logits = self.model.heads(hidden)
            ids = self.model.greedy(text_logits, function_logits)
            self.positions += 1
            evaluate(self.history[-1], text_logits, function_logits, ids)
            return text_logits[0, -1], function_logits[0, -1], ids
        if self.positions == 0:  # the caches are empty: the plain path creates their state
            hidden = self.model.backbone(self.model.fuse(self.prev_text, audio, self.prev_function), self.caches)
            out = ()
            if want_heads:
                text_logits, function_logits = self.model.heads(hidden)
                out = (text_logits, function_logits, self.model.greedy(text_logits, function_logits))
        else:
            out = self.model.cached_step(self.prev_text, audio, self.prev_function, self.caches, want_heads)
        self.positions += 1
        state = [a for c in self.caches if c is not None for a in c.arrays()]
        if not want_heads:
            evaluate(state)
            return None
        text_logits, function_logits, ids = out
        evaluate(state, text_logits, function_logits, ids)
        return text_logits[0, -1], function_logits[0, -1], ids

    def prefill(self, embeddings: mx.array) -> None:
        """embeddings: (P, D) prompt rows on the audio channel; both output channels stay pad."""
        self.prompt_embeds = embeddings
        while self.prompt_pending:
            self.feed_prompt_row()

    @property
    def prompt_pending(self) -> int:
        """Prompt rows not fed yet (a session opened with `prefill=False` feeds them one at a time)."""
        return 0 if self.prompt_embeds is None else self.prompt_embeds.shape[0] - self.prompt_positions

    def feed_prompt_row(self) -> None:
        """Feed the next prompt row alone: one position whose outputs stay pad (prev_* untouched)."""
        i = self.prompt_positions
        self._run(self.prompt_embeds[None, i : i + 1], want_heads=False)
        self.prompt_positions += 1

    def force_function(self, token_id: int) -> None:
        """Have the next step return `token_id` as its function token, and fuse it into the step after, in place
        of the function head's pick: how a tool response is read back on the function channel."""
        if not 0 <= token_id < self.model.vocab_size:
            raise ValueError(f"forced function token {token_id} is outside the vocabulary [0, {self.model.vocab_size})")
        self.forced_function = token_id

    def take_function(self, picked: int) -> int:
        """This step's function token: the forced one when there is one (used once), else the head's pick."""
        forced, self.forced_function = self.forced_function, None
        return picked if forced is None else forced

    def step(self, audio: AudioRow, return_logits: bool = False, frame_index: int | None = None) -> StepOutput:
        """audio: (D,) float32 projected perception frame (an MLX or numpy array) -> greedy text and function ids
        at this position.

        frame_index, when given, must be the number of frames stepped so far (0, 1, 2, ...)."""
        self.check_step(audio, frame_index)
        if isinstance(audio, np.ndarray):
            audio = mx.array(audio)
        out = self._run(audio.reshape(1, 1, self.model.hidden_size), want_heads=True)
        assert out is not None
        text_logits, function_logits, ids = out
        self.prev_text, picked = ids.tolist()  # evaluated already: a copy, no wait
        self.prev_function = self.take_function(picked)
        self.frames += 1
        if not return_logits:
            return StepOutput(self.prev_text, self.prev_function)
        return StepOutput(self.prev_text, self.prev_function, text_logits, function_logits)

    def snapshot(self, since: Marks | None = None) -> State:
        """The session's whole state (`services.common.snapshot`): counters, the previous ids, a forced function
        id still to use (-1: none), every layer cache's own rows (`caches.I.*`) or the full-history inputs. The
        prompt rows are not in it: a restore looks them up again from the open message. With `since` (a delta),
        the attention caches give only the keys written since the base; the rest is whole."""
        if self.closed:
            raise ValueError(f"session {self.session_id} is closed")
        state: State = {"positions": self.positions, "prompt_positions": self.prompt_positions, "frames": self.frames,
                        "prev_text": self.prev_text, "prev_function": self.prev_function,
                        "forced_function": -1 if self.forced_function is None else self.forced_function}
        state.update(items(self.caches, "caches", lambda cache: cache.snapshot(since)))
        if self.history:
            state["history"] = mx.concatenate(self.history, axis=1)  # (1, positions, D)
        return state

    def cache_dtypes(self) -> tuple:
        """The dtypes of every cached tensor (a bf16 prompt prefix keeps its attention caches in bf16, and its conv
        tails until the first f32 step). Read once per state: the caches change only when a position is fed,
        which moves the counters, or by `restore`, which forgets what was read."""
        at = (self.positions, self.prompt_positions)
        if self._dtypes is None or self._dtypes[0] != at:
            self._dtypes = at, tuple(dtype for c in self.caches if c is not None for dtype in c.dtypes())
        return self._dtypes[1]

    @staticmethod
    def share_dtypes(sessions: Sequence[LanguageSession]) -> None:
        """After a batched position, its counters moved: every member's new state is rows of the same batched
        arrays (written into buffers of the dtypes the group agreed on), so one member's read serves them all."""
        dtypes = sessions[0].cache_dtypes()
        for session in sessions[1:]:
            session._dtypes = (session.positions, session.prompt_positions), dtypes

    def restore(self, snapshot: Snapshot) -> None:
        """Take the state `snapshot` holds (a fresh session opened with the same prompt, its rows not fed)."""
        self._dtypes = None
        prompt = 0 if self.prompt_embeds is None else self.prompt_embeds.shape[0]
        if snapshot.int("prompt_positions") != prompt:
            raise ValueError(f"the snapshot's session had a prompt of {snapshot.int('prompt_positions')} positions, "
                             f"but the open message's prompt has {prompt}: restore with the session's own open")
        for name in ("positions", "prompt_positions", "frames", "prev_text", "prev_function"):
            setattr(self, name, snapshot.int(name))
        forced = snapshot.int("forced_function")
        self.forced_function = None if forced < 0 else forced
        for i, cache in enumerate(self.caches):
            if cache is not None:
                cache.restore(snapshot.scope(f"caches.{i}"))
        if snapshot.has("history"):
            history = snapshot.array("history")
            self.history = [history[:, i : i + 1] for i in range(history.shape[1])]
        mx.eval([a for cache in self.caches if cache is not None for a in cache.arrays()], self.history)

    def check_step(self, audio: AudioRow, frame_index: int | None) -> None:
        """The ValueError / LimitExceeded `step` raises for these arguments, before anything changes."""
        if self.closed:
            raise ValueError(f"session {self.session_id} is closed")
        if self.prompt_pending:
            raise ValueError(f"session {self.session_id} has {self.prompt_pending} prompt rows still to feed")
        if frame_index is not None and frame_index != self.frames:
            raise ValueError(f"frame_index {frame_index} is out of order; expected {self.frames}")
        if self.full_history and self.positions >= MAX_FULL_HISTORY_POSITIONS:
            raise LimitExceeded(f"full-history sessions are limited to {MAX_FULL_HISTORY_POSITIONS} positions")
        hidden = self.model.hidden_size
        dtype = _dtype_name(audio)
        if dtype != "float32" or tuple(audio.shape) != (hidden,):
            raise ValueError(f"audio embedding must be float32 of shape ({hidden},); "
                             f"got {dtype} of shape {tuple(audio.shape)}")


# A step's audio row: an MLX array, or a numpy one as a service decodes it from its request (a batch of those
# crosses to the device as one array, `_stacked_rows`)
AudioRow = mx.array | np.ndarray
Step = tuple[LanguageSession, AudioRow, bool, int | None]


class LanguageEngine:
    """Loads `stt_model.{embed_tokens,llm,lm_head,function_head}` and the tokenizer; opens sessions."""

    def __init__(self, config: VoiceChatConfig, model: DuplexLanguageModel, tokenizer: Tokenizer | None,
                 max_prompt_tokens: int = MAX_PROMPT_TOKENS, max_context: int | None = DEFAULT_MAX_CONTEXT) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        # attention keys a session keeps past its prompt (LoadOptions.max_context; None or 0: all of them)
        self.max_context = max_context
        self._sessions: dict[int, LanguageSession] = {}
        self._ids = itertools.count(1)
        # the Mamba states of the last batches, stacked, by their sessions (`_mamba_holders` gives the order)
        self._pools = StatePools(lambda s: s.session_id, self._mamba_holders, MASKED_SHARE)
        # attention caches of at most this many keys are stacked into groups in a batched step: on a GPU all of
        # them (the group saves every session's own write and attention), on the CPU none (reads in place)
        self.stack_up_to = stack_limit(STACK_ALL)
        # the caches the latest prompts left, by `LanguageSession.prompt_key`; 0 keeps none
        self.prompts_kept = PROMPTS_KEPT
        self._prompted: dict[tuple, list[LayerCache]] = {}

    @classmethod
    def load(cls, model_dir: str | Path, max_prompt_tokens: int = MAX_PROMPT_TOKENS,
             options: LoadOptions = AS_STORED) -> LanguageEngine:
        """options.weights_dtype "bfloat16" dequantizes quantized projections at load (more memory, dense matmuls that
        batch almost for free on a GPU); None keeps them as stored.

        options.float32_weights keeps the arrays that the float32 activations of every frame step convert in each call
        in float32 instead: the projections' dense weights or a quantized layer's scales and biases, the norms'
        weights, the Mamba convolutions' weights and D (outputs identical; twice those arrays' memory). The
        bfloat16 prompt prefix computes with them cast back.

        options.split_matmuls (a CUDA GPU only) has the dense bf16 projections (weights_dtype "bfloat16", or a bf16
        checkpoint) meet float32 activations in `split_matmul`, on the tensor cores at float32's accuracy,
        instead of a cast or a float32 copy; with float32_weights the other arrays are still kept in float32."""
        if options.split_matmuls:
            split_matmul.require()
        checkpoint = Checkpoint(model_dir)
        try:
            weights = checkpoint.load(WEIGHT_PREFIXES)
            if options.weights_dtype == "bfloat16":
                weights = weights.dequantized(mx.bfloat16)
            model = DuplexLanguageModel.from_weights(weights, checkpoint.config)
            mx.eval([a for a in weights.arrays.values()])
            modules = [model.backbone, model.lm_head, model.function_head]
            if options.split_matmuls:
                layers.route_split_matmuls(modules, model_dir, " unless --weights-dtype bfloat16")
            if options.float32_weights:
                mx.eval(widen(modules, mx.float32, (Linear, Block, NemotronH, Mamba2Mixer)))
                del weights
                mx.clear_cache()
        finally:
            checkpoint.close()
        tokenizer_path = Path(model_dir) / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path.is_file() else None
        return cls(checkpoint.config, model, tokenizer, max_prompt_tokens, options.max_context)

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @property
    def live_sessions(self) -> int:
        return len(self._sessions)

    def prompt_ids(self, system_prompt: str) -> list[int]:
        """`[bos] + encode(prompt) + [eos]`; [] for an empty or blank prompt."""
        if not system_prompt.strip():
            return []
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json; send prompt_token_ids instead of system_prompt")
        encoded = self.tokenizer.encode(system_prompt, add_special_tokens=False).ids
        return [self.model.bos_id, *encoded, self.model.eos_id]

    def open_session(self, system_prompt: str = "", prompt_token_ids: list[int] | None = None,
                     full_history: bool = False, prefix_dtype: str = "float32",
                     prefill: bool = True, restore: Snapshot | None = None) -> LanguageSession:
        """Open a session and prefill its prompt prefix.

        prompt_token_ids, when non-empty, are used as given (bos/eos included) instead of system_prompt.
        prefix_dtype: "float32" feeds the prompt rows as the reference's offline path does (cast to float32),
        "bfloat16" as its streaming session does (raw table rows). prefill=False leaves the rows pending, to be
        fed by `prefill_batch` (one row per call, batched with other sessions' rows) before the first step.
        restore: a snapshot of a session opened with these arguments; it is taken instead of feeding the rows."""
        ids = [int(i) for i in prompt_token_ids] if prompt_token_ids else self.prompt_ids(system_prompt)
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(f"system prompt is {len(ids)} tokens (bos/eos included); "
                             f"the limit is {self.max_prompt_tokens}")
        vocab = self.model.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if prefix_dtype not in PREFIX_DTYPES:
            raise ValueError(f"prefix_dtype must be one of {sorted(PREFIX_DTYPES)}, got {prefix_dtype!r}")
        pad = self.model.pad_id
        session = LanguageSession(next(self._ids), self.model, full_history, prev_text=pad, prev_function=pad)
        if not full_history:  # the prompt's keys are kept for good, then the last max_context positions
            session.caches = self.model.make_caches(context_bound(len(ids), self.max_context))
        if ids:
            rows = self.model.embed_tokens(mx.array(ids, dtype=mx.int32)).astype(PREFIX_DTYPES[prefix_dtype])
            if not full_history and restore is None and self.prompts_kept:
                # what the caches' contents and sizes follow
                session.prompt_key = (tuple(ids), prefix_dtype, self.max_context, cache_layout.GROW)
            if not self._take_prompted(session, rows):
                if restore is None and (prefill or full_history):
                    session.prefill(rows)
                    self._keep_prompted(session)
                else:
                    session.prompt_embeds = rows
                    mx.eval(rows)
        if restore is not None:
            session.restore(restore)
        self._sessions[session.session_id] = session
        return session

    def _take_prompted(self, session: LanguageSession, rows: mx.array) -> bool:
        """Give an opening session copies of the caches its prompt left in an earlier session, when they are
        kept: its prompt counts as fed. A prompt's rows draw no random numbers and see nothing of the session, so
        these are the bits feeding them would give (fed the way that earlier session's were)."""
        template = self._prompted.pop(session.prompt_key, None) if session.prompt_key is not None else None
        if template is None:
            return False
        self._prompted[session.prompt_key] = template  # now the most recently used
        session.caches = _copies(template)
        session.positions = session.prompt_positions = rows.shape[0]
        session.prompt_embeds = rows
        mx.eval(rows)
        return True

    def take_prompted(self, session: LanguageSession) -> bool:
        """A session opened with its prompt rows pending and none fed yet takes copies of the caches its prompt
        left in another session since (True: its prompt counts as fed), when they are kept; else (False) it is
        left as it was, to feed its own."""
        if session.closed or session.positions or session.frames or not session.prompt_pending:
            return False
        return self._take_prompted(session, session.prompt_embeds)

    def _keep_prompted(self, session: LanguageSession) -> None:
        """Keep copies of the caches a session's whole prompt left, before its first step, for the next
        sessions opening with that prompt (`_take_prompted`); the template itself never steps."""
        if session.prompt_key is None or session.prompt_pending or session.frames:
            return

        def template() -> list[LayerCache]:
            caches = _copies(session.caches)
            mx.eval([a for c in caches if c is not None for a in c.arrays()])
            return caches

        kept(self._prompted, session.prompt_key, template, self.prompts_kept)

    def close_session(self, session: LanguageSession) -> None:
        """Free the session's caches; closing twice is a no-op."""
        session.closed = True
        self._pools.drop(session.session_id)
        session.caches.clear()
        session.history.clear()
        self._sessions.pop(session.session_id, None)

    # ---- several sessions' steps at once --------------------------------------------------------------------

    def precompile(self, max_batch: int, steps: int = 2) -> None:
        """Feed `steps` batched prompt rows (then one row of all but one of them, over all their rows), then run
        `steps` batched steps, at every batch size 1..max_batch on throwaway sessions opened the way a streaming
        session is (bf16 prompt prefix, fed a row per batch), each size's batch followed by one step of all but
        one of it (the step over all its rows that leaves one session's states as they are), then one step of
        some of the last batch's sessions at each size below it (their stacked states and caches kept, as when
        some sessions' frames are not due), then at each size the openings of sessions opening together
        (`_precompile_openings`). So the compiled pieces of each size are traced (and, on a GPU, every kernel
        built) before a client's frame waits for them. The steps' sessions are closed before the openings open
        theirs, so no more sessions are live at once than the largest batch. Leaves no session open, and no
        prompt's caches kept (each of its sessions feeds its own prompt)."""
        rows = min((steps + 1) * max_batch + 2, self.max_prompt_tokens)
        prompt = [self.model.bos_id, *[self.model.eos_id] * (rows - 1)]
        prompts_kept, self.prompts_kept = self.prompts_kept, 0
        sessions = [self.open_session(prompt_token_ids=prompt, prefix_dtype="bfloat16", prefill=False)
                    for _ in range(max_batch)]
        try:
            self._precompile_prompt_rows(sessions, steps)
            self._precompile_steps(sessions, steps)
            for session in sessions:  # closed before the openings: never more sessions live than a step holds
                self.close_session(session)
            for size in range(1, max_batch + 1):
                self._precompile_openings(size, sessions)
        finally:
            self.prompts_kept = prompts_kept
            for session in sessions:
                self.close_session(session)

    def _precompile_openings(self, size: int, opened: list[LanguageSession]) -> None:
        """`precompile`'s openings at `size`, of sessions with a one-row prompt (their first step's states still
        hold the prompt rows' dtype) and of sessions without one (float32 rows into empty caches): `size` of them
        open together, take their first position as one batch and one step more (their caches, split from the
        first position's, stacked again); then half of them open and take a first step, the rest open and step
        with them (first positions beside a group's step), and all step once more (the group and the newcomers
        stacked). A group's later steps are `_precompile_steps`' already. Each set is closed before the next
        opens: no more sessions live at once than a step of `size` holds. The sessions are added to `opened`
        (closed ones included), so a failure closes them."""
        prompted = dict(prompt_token_ids=[self.model.bos_id], prefix_dtype="bfloat16", prefill=False)
        for spec in (prompted, {}):  # a one-row prompt; none (the first step is the first position)
            for waves in ([size], [size // 2, size - size // 2]):
                if min(waves) == 0:
                    continue
                live: list[LanguageSession] = []
                for wave in waves:
                    fresh = [self.open_session(**spec) for _ in range(wave)]
                    opened += fresh
                    if spec:
                        raise_first(self.prefill_batch(fresh))
                    live += fresh
                    raise_first(self.step_batch([(s, self._zero_audio, False, None) for s in live]))
                raise_first(self.step_batch([(s, self._zero_audio, False, None) for s in live]))
                for session in live:
                    self.close_session(session)

    @property
    def _zero_audio(self) -> mx.array:
        return mx.zeros((self.model.hidden_size,), mx.float32)

    def _over_all_rows(self, size: int) -> bool:
        """Whether all but one of a batch of `size` step over all its rows (`StatePools`' masked share)."""
        return size - 1 >= max(2, self._pools.masked_share * size)

    def _precompile_prompt_rows(self, sessions: list[LanguageSession], steps: int) -> None:
        """`precompile`'s prompt rows: each first row alone, then `steps` rows at each size (and a row of all but
        one over all their rows), then the rows left."""
        raise_first(self.prefill_batch(sessions))  # every first row: it creates the caches
        for size in range(1, len(sessions) + 1):
            for _ in range(steps):
                if all(s.prompt_pending for s in sessions[:size]):  # a short --max-prompt-tokens runs out
                    raise_first(self.prefill_batch(sessions[:size]))
            if self._over_all_rows(size) and all(s.prompt_pending for s in sessions[:size]):
                raise_first(self.prefill_batch(sessions[: size - 1]))  # a prompt row over all `size` rows
        while any(s.prompt_pending for s in sessions):
            raise_first(self.prefill_batch([s for s in sessions if s.prompt_pending]))

    def _precompile_steps(self, sessions: list[LanguageSession], steps: int) -> None:
        """`precompile`'s steps: `steps` at each size (and one of all but one over all their rows), then some of
        the last batch's sessions at each size below it."""
        audio = self._zero_audio
        for size in range(1, len(sessions) + 1):
            for _ in range(steps):
                raise_first(self.step_batch([(s, audio, False, None) for s in sessions[:size]]))
            if self._over_all_rows(size):  # all but one: the step over all `size` rows
                raise_first(self.step_batch([(s, audio, False, None) for s in sessions[: size - 1]]))
        for size in range(len(sessions) - 1, 1, -1):  # some of the last batch's sessions: its stacks kept
            raise_first(self.step_batch([(s, audio, False, None) for s in sessions[:size]]))

    def step_batch(self, steps: Sequence[Step]) -> list[StepOutput | Exception]:
        """Each entry is the arguments of `session.step(audio, return_logits, frame_index)`; returns what each
        call would (or the ValueError / LimitExceeded it would raise, that session untouched), in order.

        Sessions with cached state of the same dtypes step together as one batched forward (`BatchedStep`);
        sessions at their first position (empty caches: opened together, no prompt) as one forward of their
        own (`_first_positions`); a single entry, full-history sessions and a group of one take the solo path.
        Each session's state stays its own, so sessions may move between solo and batched steps at any
        position. The only numeric difference from solo is the rounding of matmuls over B rows: on CUDA, MLX
        runs float32 GEMMs over B >= 2 rows in TF32 unless MLX_ENABLE_TF32=0 (logits ~4e-2 off instead of ~4e-5,
        enough to flip a near-tied argmax); quantized matmuls are per-row exact."""
        if len({id(step[0]) for step in steps}) != len(steps):
            raise ValueError("a session appears twice in one batch")

        def signature(step: Step) -> tuple | None:
            session, audio, _, frame_index = step
            if len(steps) == 1 or not self._joins(session) or self._rejects(session, audio, frame_index):
                return None  # alone: a bad entry's step raises there, touching nothing
            if not session.positions:
                return _first_signature(session, audio)
            return session.cache_dtypes()  # sessions batch together only when these agree

        batched, solo = group_by_signature(steps, signature, lambda step: step[0].session_id)
        results: list[StepOutput | Exception | None] = [None] * len(steps)
        for i in solo:
            try:
                results[i] = steps[i][0].step(*steps[i][1:])
            except (ValueError, LimitExceeded) as exc:
                results[i] = exc
        first = [m for m in batched if not steps[m[0]][0].positions]
        cached = [m for m in batched if steps[m[0]][0].positions]
        done = [*((m, self._first_positions([steps[i] for i in m])) for m in first),
                *zip(cached, self._run_groups([[steps[i] for i in m] for m in cached]), strict=True)]
        for members, outputs in done:
            for i, out in zip(members, outputs, strict=True):
                results[i] = out
        return results  # type: ignore[return-value]

    def prefill_batch(self, sessions: Sequence[LanguageSession]) -> list[Exception | None]:
        """Feed the next pending prompt row of each session (opened with `prefill=False`). Sessions whose caches
        hold a position already and agree in dtypes, their rows' included, run one batched forward without the
        heads; the others feed theirs alone. Entry i is None, or a ValueError for a session with nothing to
        feed. A row fed batched or alone leaves the same state (on this CPU bit for bit)."""
        if len({id(s) for s in sessions}) != len(sessions):
            raise ValueError("a session appears twice in one batch")
        results: list[Exception | None] = [None] * len(sessions)
        for i, session in enumerate(sessions):
            if session.closed or not session.prompt_pending:
                results[i] = ValueError(f"session {session.session_id} has no prompt rows left to feed")

        def signature(session: LanguageSession) -> tuple | None:
            if len(sessions) == 1 or not self._joins(session) or not session.prompt_pending:
                return None
            row = session.prompt_embeds[session.prompt_positions]
            if not session.positions:
                return _first_signature(session, row)
            return session.cache_dtypes(), row.dtype

        batched, solo = group_by_signature(sessions, signature, lambda s: s.session_id)
        for i in solo:
            if results[i] is None:
                sessions[i].feed_prompt_row()
        rows = [[(s, s.prompt_embeds[s.prompt_positions], False, None) for s in (sessions[i] for i in members)]
                for members in batched]
        first = [g for g in rows if not g[0][0].positions]
        self._run_groups([g for g in rows if g[0][0].positions], heads=False)
        for group in first:
            self._first_positions(group, heads=False)
        for session, result in zip(sessions, results, strict=True):
            if result is None:
                self._keep_prompted(session)
        return results

    def _joins(self, session: LanguageSession) -> bool:
        """Whether the session may step with others: one of this model's, open, on caches."""
        return session.model is self.model and not session.closed and not session.full_history

    def _first_positions(self, steps: list[Step], heads: bool = True) -> list[StepOutput] | list[None]:
        """Sessions at their first position (caches empty; every entry checked, one `_first_signature`) run it
        as one forward of B rows: the plain path's, into caches made for the B of them, which each session then
        takes its row of, as its own first position would have left its caches. The rows differ from each
        session's own only by the rounding of matmuls over B rows, as a batched step's do. Each entry's output
        (without `heads`, prompt rows: counted as fed, no outputs)."""
        sessions = [step[0] for step in steps]
        b, model = len(sessions), self.model
        caches = model.make_caches(_bound(sessions[0]))
        audio = _stacked_rows([step[1] for step in steps]).reshape(b, 1, -1)
        prev_text = mx.array([[s.prev_text] for s in sessions], dtype=mx.int32)
        prev_function = mx.array([[s.prev_function] for s in sessions], dtype=mx.int32)
        hidden = model.backbone(model.fuse_ids(prev_text, audio, prev_function), caches)
        out: tuple[mx.array, ...] = ()
        if heads:
            text_logits, function_logits = model.heads(hidden)
            ids = mx.stack([mx.argmax(text_logits[:, -1], axis=-1), mx.argmax(function_logits[:, -1], axis=-1)],
                           axis=1)  # (B, 2): each row's greedy pair
            out = (text_logits, function_logits, ids)
        evaluate(*out, [a for c in caches if c is not None for a in c.arrays()])
        # several sessions keep the forward's arrays as they are, so their next batched step stacks nothing: its
        # attention caches as a group's arrays, its states as a pool's stacks (handed to empty holders)
        states = [a for i in self.model.batched_step.mamba_layers for a in caches[i].state] if b > 1 else []
        pooled = bool(states) and all(a is not None for a in states)
        rows = [[None] * b if c is None else LayerGroup.of_batched(c, 1) if b > 1 and isinstance(c, FullCache)
                else [MambaCache() for _ in range(b)] if pooled and isinstance(c, MambaCache) else c.split_rows()
                for c in caches]
        for r, session in enumerate(sessions):
            session.caches = [layer[r] for layer in rows]
            session.positions += 1
        if pooled:
            self._pools.scatter(Gathered(list(sessions), list(range(b)), None, states), states)
        if not heads:
            return _fed(sessions)
        return self._finish(steps, list(range(b)), out)

    @staticmethod
    def _rejects(session: LanguageSession, audio: mx.array, frame_index: int | None) -> bool:
        try:
            session.check_step(audio, frame_index)
        except (ValueError, LimitExceeded):
            return True
        return False

    def _mamba_holders(self, session: LanguageSession) -> list[MambaCache]:
        """The session's Mamba caches, in `BatchedStep.mamba_layers` order: the states a batched step takes."""
        return [session.caches[i] for i in self.model.batched_step.mamba_layers]

    def _run_groups(self, groups: list[list[Step]], heads: bool = True) -> list[list[StepOutput | None]]:
        """Each group's batched step (every entry checked already), all evaluated at once; each group's outputs
        (without `heads`, prompt rows: counted as fed, no outputs)."""
        if not groups:
            return []
        to_eval = self._pools.settle([[step[0] for step in steps] for steps in groups])
        finishes = [self._step_group(steps, to_eval, heads) for steps in groups]
        evaluate(to_eval)
        return [finish() for finish in finishes]

    def _step_group(self, steps: list[Step], to_eval: list[mx.array], heads: bool = True):
        """Gather one group's states, run its batched step, scatter the new states back, appending what to
        evaluate to `to_eval`; returns the function that, after evaluation, advances the sessions."""
        sessions = [step[0] for step in steps]
        batch = self._pools.gather(sessions)
        b, members = len(batch.members), batch.members
        audio = _stacked_rows(batch.place([step[1] for step in steps], None))
        prev_text = mx.array([[s.prev_text] for s in members], dtype=mx.int32)
        prev_function = mx.array([[s.prev_function] for s in members], dtype=mx.int32)
        out, states = self.model.batched_step(prev_text, audio.reshape(b, 1, -1), prev_function, batch.states,
                                              [s.caches for s in members], heads, batch.active, self.stack_up_to)
        to_eval += [*self._pools.scatter(batch, states), *out]
        written = {id(a): a for s in sessions for i in self.model.batched_step.attention_layers
                   for a in s.caches[i].buffers()}  # a group's pair once, not a view per member
        to_eval += written.values()
        for session in sessions:
            session.positions += 1
        return functools.partial(self._finish, steps, batch.rows, out) if heads else functools.partial(_fed, sessions)

    @staticmethod
    def _finish(steps: list[Step], rows: list[int], out: tuple[mx.array, ...]) -> list[StepOutput]:
        """After evaluation: each entry's ids (and logits when asked) from its row, the session advanced."""
        text_logits, function_logits, ids = out
        every, outputs = ids.tolist(), []
        for row, (session, _, return_logits, _) in zip(rows, steps, strict=True):
            text_id, function_id = every[row]
            session.prev_text, session.prev_function = text_id, session.take_function(function_id)
            session.frames += 1
            logits = (text_logits[row, -1], function_logits[row, -1]) if return_logits else ()
            outputs.append(StepOutput(text_id, session.prev_function, *logits))
        LanguageSession.share_dtypes([step[0] for step in steps])
        return outputs


def _stacked_rows(rows: Sequence[AudioRow | None]) -> mx.array:
    """(B, D): row b is rows[b], zeros where it is None (a pool's row sitting the step out). Rows that are all
    numpy (a service's decoded requests) are written into one host buffer that becomes one array: one copy to the
    device, where stacking B arrays would make B of them and a copy kernel each. The values are the same."""
    first = next(row for row in rows if row is not None)
    if all(row is None or isinstance(row, np.ndarray) for row in rows):
        out = np.zeros((len(rows), *first.shape), first.dtype)
        for b, row in enumerate(rows):
            if row is not None:
                out[b] = row
        return mx.array(out)
    arrays = [row if row is None or isinstance(row, mx.array) else mx.array(row) for row in rows]
    zero = mx.zeros(first.shape, next(a for a in arrays if a is not None).dtype)
    return mx.stack([zero if a is None else a for a in arrays])


def _bound(session: LanguageSession):
    """The bound its attention caches hold keys to (None: unbounded, or no attention layer)."""
    return next((c.bound for c in session.caches if isinstance(c, FullCache)), None)


def _first_signature(session: LanguageSession, row: AudioRow) -> tuple:
    """What sessions at their first position must share to run it as one forward: its caches' bound and the
    dtype of the row it feeds (a step's float32 audio, a prompt row's prefix dtype)."""
    return "first", _bound(session), _dtype_name(row)


def _dtype_name(row: AudioRow) -> str:
    """An MLX or numpy array's dtype by name: mlx.core.float32 and numpy's float32 alike read "float32"."""
    return str(row.dtype).rpartition(".")[2]


def _copies(caches: list[LayerCache]) -> list[LayerCache]:
    """Each cache's copy in arrays of its own (None where a block has no cache)."""
    return [None if c is None else c.copy() for c in caches]


def _fed(sessions: list[LanguageSession]) -> list[None]:
    """After evaluation of a batch of prompt rows: each counted as fed."""
    for session in sessions:
        session.prompt_positions += 1
    LanguageSession.share_dtypes(sessions)
    return [None] * len(sessions)
