"""RNNT transcript branch: LSTM prediction network, joint network, greedy decoding (pieces -> text: vocabulary.py).

Greedy per encoder frame: predict from the last emitted token (zeros while it is blank), join with the frame,
take the argmax; blank ends the frame, anything else is emitted and advances the predictor, at most
`max_symbols` times per frame. `<unk>`, `<pad>`, `<s>`, `</s>` and `<xx-XX>` language tags advance the
predictor but are not part of the text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx

from services.common.checkpoint import Weights
from services.common.layers import Embedding, Linear
from services.perception.vocabulary import is_special_piece, join_pieces


@dataclass
class LSTMLayer:
    """One LSTM layer, gates i, f, g, o; Wx (4H, in), Wh (4H, H), bias (4H,) = b_ih + b_hh."""

    Wx: mx.array
    Wh: mx.array
    bias: mx.array
    wide: tuple[mx.array, mx.array, mx.array] | None = None  # (Wx, Wh, bias) in float32, from `keep_float32`

    def keep_float32(self) -> list[mx.array]:
        """Also keep float32 copies of the arrays, for the matmuls whose input is float32 (MLX would convert the
        narrower arrays in every such call; the copies hold the same values). A bf16 input (an embedding row)
        still computes with the arrays as stored. Returns the copies, to evaluate."""
        self.wide = tuple(a.astype(mx.float32) for a in (self.Wx, self.Wh, self.bias))
        return list(self.wide)

    def _for(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.wide if self.wide is not None and x.dtype == mx.float32 else (self.Wx, self.Wh, self.bias)

    def __call__(self, x: mx.array, h: mx.array | None, c: mx.array | None) -> tuple[mx.array, mx.array]:
        """One time step: x (B, in), h/c (B, H) or None for a zero state -> (h', c')."""
        Wx, _, bias = self._for(x)
        gates = mx.addmm(bias, x, Wx.T)
        if h is not None:
            gates = mx.addmm(gates, h, self._for(h)[1].T)
        i, f, g, o = mx.split(gates, 4, axis=-1)
        i, f, g, o = mx.sigmoid(i), mx.sigmoid(f), mx.tanh(g), mx.sigmoid(o)
        c = i * g if c is None else f * c + i * g
        return o * mx.tanh(c), c


@dataclass
class PredictionNetwork:
    embed: Embedding
    layers: list[LSTMLayer]
    hidden: int

    @classmethod
    def from_weights(cls, weights: Weights, path: str, num_layers: int, hidden: int) -> PredictionNetwork:
        stem = f"{path}.prediction.dec_rnn.lstm"
        layers = [LSTMLayer(weights.get(f"{stem}.{n}.Wx"), weights.get(f"{stem}.{n}.Wh"),
                            weights.get(f"{stem}.{n}.bias")) for n in range(num_layers)]
        return cls(Embedding.from_weights(weights, f"{path}.prediction.embed"), layers, hidden)

    def __call__(
        self, token: int | mx.array | None, state: tuple[list[mx.array], list[mx.array]] | None
    ) -> tuple[mx.array, tuple[list[mx.array], list[mx.array]]]:
        """token: last emitted id (an int or a scalar array), or None for blank (zero input); state: per-layer
        (h, c) lists (B=1). Returns (output (1, 1, H), new state)."""
        if token is None:
            x = mx.zeros((1, self.hidden), dtype=mx.float32)
        elif isinstance(token, mx.array):
            x = self.embed(token.reshape(1).astype(mx.int32))
        else:
            x = self.embed(mx.array([token], dtype=mx.int32))
        hs, cs = [], []
        for n, layer in enumerate(self.layers):
            h, c = layer(x, *((state[0][n], state[1][n]) if state is not None else (None, None)))
            hs.append(h)
            cs.append(c)
            x = h
        return x[None], (hs, cs)


@dataclass
class JointNetwork:
    enc: Linear
    pred: Linear
    out: Linear
    activation: str = "relu"

    @classmethod
    def from_weights(cls, weights: Weights, path: str, activation: str) -> JointNetwork:
        return cls(Linear.from_weights(weights, f"{path}.enc"), Linear.from_weights(weights, f"{path}.pred"),
                   Linear.from_weights(weights, f"{path}.joint_net.2"), activation)

    def __call__(self, enc_proj: mx.array, pred: mx.array) -> mx.array:
        """enc_proj: (1, 1, J) = enc(frame); pred: (1, 1, H) -> logits (1, 1, 1, V + 1)."""
        x = enc_proj[:, :, None, :] + self.pred(pred)[:, None, :, :]
        if self.activation == "relu":
            x = mx.maximum(x, 0)
        elif self.activation == "sigmoid":
            x = mx.sigmoid(x)
        else:
            x = mx.tanh(x)
        return self.out(x)


class TextSoFar(NamedTuple):
    """A stream's transcript as of one frame, joined only when read: the stream's deltas (a list that only
    grows) and how many of them were in by then."""

    deltas: list[str]
    count: int

    def __str__(self) -> str:
        return "".join(self.deltas[: self.count])


@dataclass
class RNNTState:
    """Per-session decoder state: last emitted token (blank at start), LSTM state, emitted text ids.

    Decoding a whole utterance keeps every id in `token_ids`; a stream's `update_text` takes the frame's ids out
    of it and keeps the transcript as its deltas, so a frame costs its own pieces, not the transcript's length."""

    blank: int
    last_token: int = -1
    lstm: tuple[list[mx.array], list[mx.array]] | None = None
    token_ids: list[int] = field(default_factory=list)  # non-special emissions not yet made text
    held: str = ""  # the joined pieces' trailing whitespace: part of the text once more text follows it
    last_emitted: int = 0  # symbols the last decoded frame emitted: how deep the next frame speculates
    deltas: list[str] = field(default_factory=list)  # the transcript's non-empty deltas, in order

    @property
    def text(self) -> str:
        """The transcript: the pieces so far joined and stripped."""
        return "".join(self.deltas)

    def so_far(self) -> TextSoFar:
        return TextSoFar(self.deltas, len(self.deltas))

    def __post_init__(self) -> None:
        if self.last_token < 0:
            self.last_token = self.blank


@dataclass
class Proposal:
    """A few greedy RNNT steps of one frame, built before any of them is read back.

    Step i (after the first) assumes step i-1 emitted, so it predicts from that step's id and LSTM state; only
    the steps up to the first blank are accepted, and those computed exactly what one-at-a-time decoding
    computes. ids: (n,) uint32; states[i]: the LSTM state that accepting step i leaves (already cast)."""

    enc_proj: mx.array
    ids: mx.array
    states: list[tuple[list[mx.array], list[mx.array]]]

    def arrays(self) -> list[mx.array]:
        return [self.ids, *(a for hs, cs in self.states for a in (*hs, *cs))]


@dataclass
class BatchProposal:
    """`Proposal`s of B sessions built as one graph: enc_proj (B, 1, J), ids (B, n) uint32, states[i] per-layer
    (h, c) lists of (B, H) rows: what accepting step i leaves each session."""

    enc_proj: mx.array
    ids: mx.array
    states: list[tuple[list[mx.array], list[mx.array]]]

    def arrays(self) -> list[mx.array]:
        return [self.ids, *(a for hs, cs in self.states for a in (*hs, *cs))]


SYMBOLS_PER_READ = 2  # the fewest greedy steps built per host read: most frames emit none or one symbol


@dataclass
class RNNT:
    prediction: PredictionNetwork
    joint: JointNetwork
    vocabulary: list[str]
    blank: int
    max_symbols: int
    _compiled: dict = field(default_factory=dict, repr=False, compare=False)  # (dtype, has state) -> greedy step

    def new_state(self) -> RNNTState:
        return RNNTState(self.blank)

    def first_steps(self, state: RNNTState) -> int:
        """Greedy steps to build before a frame's first host read: one more than the last frame emitted, at
        least SYMBOLS_PER_READ, at most max_symbols. A run of busy frames then costs one read a frame, not one per
        two symbols; the steps past the first blank are computed for nothing, and change no output."""
        return min(self.max_symbols, max(SYMBOLS_PER_READ, state.last_emitted + 1))

    @staticmethod
    def more_steps(built: int, left: int) -> int:
        """Greedy steps to build for a frame whose `built` proposed steps all emitted, `left` symbols allowed:
        twice as many, so a frame takes a number of reads logarithmic in what it emits."""
        return min(left, 2 * built)

    def propose(self, state: RNNTState, enc_proj: mx.array, steps: int, dtype: mx.Dtype) -> Proposal:
        """Build (without evaluating) `steps` greedy steps from `state`; enc_proj: (1, 1, J) = joint.enc(frame)."""
        if state.last_token == self.blank:
            x = mx.zeros((1, self.prediction.hidden), dtype=mx.float32)
        else:
            x = self.prediction.embed(mx.array([state.last_token], dtype=mx.int32))
        hs, cs = state.lstm if state.lstm is not None else ([], [])
        ids, states = self._greedy(enc_proj, x, hs, cs, steps, dtype)
        return Proposal(enc_proj, mx.concatenate(ids), states)

    def _greedy(
        self, enc_proj: mx.array, x: mx.array, hs: list[mx.array], cs: list[mx.array], steps: int, dtype: mx.Dtype
    ) -> tuple[list[mx.array], list[tuple[list[mx.array], list[mx.array]]]]:
        """`steps` greedy steps of B rows, each assuming the one before emitted: x (B, in) the first step's LSTM
        input, hs/cs the per-layer (B, H) state (empty lists for none). Returns each step's ids (B,) and the
        state it leaves (cast to dtype). One compiled function per step (`greedy_step`)."""
        ids, states = [], []
        for _ in range(steps):
            key = (dtype, bool(hs))  # a zero state (a session's first emission still to come) has its own trace
            if key not in self._compiled:
                self._compiled[key] = mx.compile(functools.partial(self.greedy_step, dtype))
            best, x, hs, cs = self._compiled[key](enc_proj, x, hs, cs)
            ids.append(best)
            states.append((hs, cs))
        return ids, states

    def greedy_step(
        self, dtype: mx.Dtype, enc_proj: mx.array, x: mx.array, hs: list[mx.array], cs: list[mx.array]
    ) -> tuple[mx.array, mx.array, list[mx.array], list[mx.array]]:
        """One greedy step of B rows: enc_proj (B, 1, J), x (B, in) the LSTM input, hs/cs the per-layer (B, H)
        state or empty lists for a zero state. Returns the argmax ids (B,) uint32, the next step's LSTM input
        (the ids' embeddings; a blank's lookup kept in range: a blank ends the frame, so its next step is never
        accepted) and the new state cast to dtype."""
        new_h, new_c = [], []
        for n, layer in enumerate(self.prediction.layers):
            x, c = layer(x, hs[n] if hs else None, cs[n] if cs else None)
            new_h.append(x.astype(dtype))
            new_c.append(c.astype(dtype))
        logits = self.joint(enc_proj, x[:, None].astype(dtype))  # (B, 1, 1, V + 1)
        best = mx.argmax(logits.reshape(x.shape[0], -1), axis=-1)
        following = self.prediction.embed(mx.minimum(best, self.prediction.embed.num_embeddings - 1)
                                          .astype(mx.int32))
        return best, following, new_h, new_c

    def begin_frame(self, state: RNNTState, frame: mx.array) -> Proposal | None:
        """frame: (1, 1, d_model) encoder output -> the frame's first greedy steps, unevaluated (None when
        max_symbols is 0). Evaluate `proposal.arrays()` with the frame's other outputs, then `end_frame`."""
        if self.max_symbols <= 0:
            return None
        return self.propose(state, self.joint.enc(frame), self.first_steps(state), frame.dtype)

    def begin_batch(
        self, states: list[RNNTState], frames: mx.array, lstm: tuple[list[mx.array], list[mx.array]]
    ) -> BatchProposal | None:
        """`begin_frame` for B sessions at once: frames (B, 1, d_model), row b for states[b]; lstm: per-layer
        (h, c) of (B, H), the sessions' LSTM states with zero rows where a state is None. A zero row gives what
        the solo step's missing state gives (x @ W of zeros adds exactly nothing, f * 0 + i * g == i * g),
        and a blank's zero input likewise; only the matmuls over B rows may round differently."""
        if self.max_symbols <= 0:
            return None
        steps = max(self.first_steps(state) for state in states)
        return self.propose_batch(states, self.joint.enc(frames), lstm, steps, frames.dtype)

    def propose_batch(
        self, states: list[RNNTState], enc_proj: mx.array, lstm: tuple[list[mx.array], list[mx.array]], steps: int,
        dtype: mx.Dtype,
    ) -> BatchProposal:
        """`propose` for B sessions at once; enc_proj: (B, 1, J), lstm as in `begin_batch`."""
        blank = [s.last_token == self.blank for s in states]
        x = self.prediction.embed(mx.array([0 if z else s.last_token for z, s in zip(blank, states, strict=True)],
                                            dtype=mx.int32))
        if any(blank):
            x = mx.where(mx.array(blank)[:, None], 0, x)
        ids, out = self._greedy(enc_proj, x, *lstm, steps, dtype)
        return BatchProposal(enc_proj, mx.stack(ids, axis=1), out)

    def end_frame(self, state: RNNTState, proposal: Proposal | None) -> list[int]:
        """Accept the proposed steps up to the first blank, proposing more while every step emitted (at most
        `max_symbols` in all); advances `state` and returns the ids emitted (specials included, blanks not).
        One host read per proposal."""
        emitted: list[int] = []
        while proposal is not None:
            if not self.accept(state, proposal.ids.tolist(), proposal.states, emitted):
                break
            dtype = proposal.states[0][0][0].dtype
            steps = self.more_steps(len(proposal.states), self.max_symbols - len(emitted))
            proposal = self.propose(state, proposal.enc_proj, steps, dtype)
        return emitted

    def accept(
        self, state: RNNTState, ids: list[int], states: list[tuple[list[mx.array], list[mx.array]]],
        emitted: list[int],
    ) -> bool:
        """Accept proposed `ids` up to the first blank (`states[i]`: the LSTM state step i leaves), appending to
        `emitted` (the frame's emissions so far); True when every step emitted and `max_symbols` allows more, so
        the frame needs more steps. When False the frame is done: `state.last_emitted` records its count."""
        accepted = ids.index(self.blank) if self.blank in ids else len(ids)
        if accepted:
            state.last_token = ids[accepted - 1]
            state.lstm = states[accepted - 1]
        for best in ids[:accepted]:
            emitted.append(best)
            if best < len(self.vocabulary) and not is_special_piece(self.vocabulary[best]):
                state.token_ids.append(best)
        more = accepted == len(ids) and self.max_symbols - len(emitted) > 0
        if not more:
            state.last_emitted = len(emitted)
        return more

    def decode_frame(self, state: RNNTState, frame: mx.array) -> list[int]:
        """frame: (1, 1, d_model) encoder output. Advances `state`; returns every id emitted on this frame
        (specials included, blanks not); at most `max_symbols`."""
        return self.end_frame(state, self.begin_frame(state, frame))

    def transcript_update(self, state: RNNTState, frame: mx.array) -> tuple[list[int], str]:
        """Decode one frame and refresh `state.text`; returns (ids emitted, text delta): the text's new suffix
        (the text only grows at its end, so the deltas sum to it)."""
        return self.finish_transcript(state, self.begin_frame(state, frame))

    def finish_transcript(self, state: RNNTState, proposal: Proposal | None) -> tuple[list[int], str]:
        """`transcript_update` for a frame whose first steps `begin_frame` already built."""
        before = len(state.token_ids)
        emitted = self.end_frame(state, proposal)
        return emitted, self.update_text(state, before)

    def update_text(self, state: RNNTState, before: int) -> str:
        """Extend the transcript by a frame's emissions (state.token_ids[before:], taken out of it with any before
        them); returns the delta.

        The text is the joined pieces stripped, which only ever grows at its end: a frame costs its own pieces,
        not the transcript's length."""
        new = state.token_ids[before:]
        state.token_ids.clear()
        if not new:
            return ""
        added = state.held + join_pieces(new, self.vocabulary)
        if not state.deltas:  # leading whitespace is never part of the text
            added = added.lstrip()
        delta = added.rstrip()
        state.held = added[len(delta) :]
        if delta:
            state.deltas.append(delta)
        return delta
