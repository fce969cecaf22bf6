"""Character-aware subword conditioning: each text id becomes one embedding built from its characters.

The character table is dense: the tokenizer's single-character tokens sorted by id (256 of them) plus one
padding index (257 rows). A subword's characters run through one T5Gemma encoder layer (bf16, logit softcap),
are mean-pooled over the real characters and projected; continuation and BOS/EOS flag embeddings are added:

    table = CharTable.from_vocabulary(tokenizer.get_vocab(), 257)
    encoder(ids, mask, table)   # ids, mask: (B, T) -> (B, T, D) bf16
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import mlx.core as mx

from services.common.checkpoint import Weights
from services.common.config import CharacterEncoderConfig
from services.common.layers import Embedding, Linear
from services.tts.blocks import GatedMLP, OffsetRMSNorm


@dataclass(frozen=True)
class CharTable:
    """subword id -> its characters as dense character ids; `padding` fills short rows."""

    subword_chars: dict[int, tuple[int, ...]]
    padding: int

    @classmethod
    def from_vocabulary(cls, vocabulary: Mapping[str, int], table_rows: int) -> CharTable:
        """vocabulary: token -> id (with added tokens); table_rows: rows of embed_tokens (characters + 1)."""
        singles = sorted((idx, token) for token, idx in vocabulary.items() if len(token) == 1)
        char_ids = {token: dense for dense, (_, token) in enumerate(singles)}
        if len(char_ids) + 1 != table_rows:
            raise ValueError(
                f"the tokenizer has {len(char_ids)} single-character tokens, but the character embedding has "
                f"{table_rows} rows (expects {table_rows - 1} characters + 1 padding): wrong tokenizer.json?"
            )
        chars = {idx: tuple(char_ids[c] for c in token if c in char_ids) for token, idx in vocabulary.items()}
        return cls(chars, table_rows - 1)

    def batch(self, ids: list[int]) -> tuple[mx.array, mx.array] | None:
        """Padded character ids (N, L) int32 and lengths (N,) int32; None when no id has characters."""
        rows = [self.subword_chars.get(i, ()) for i in ids]
        width = max((len(r) for r in rows), default=0)
        if width == 0:
            return None
        padded = [list(r) + [self.padding] * (width - len(r)) for r in rows]
        return mx.array(padded, mx.int32), mx.array([len(r) for r in rows], mx.int32)


@dataclass
class CharSelfAttention:
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    n_heads: int
    n_kv_heads: int
    scale: float
    softcap: float
    rope_base: float

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        """x: (N, L, D); mask: (N, L) bool, True on real characters."""
        n, length, _ = x.shape
        q = self.q_proj(x).reshape(n, length, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(n, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(n, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        dims = q.shape[-1]
        q = mx.fast.rope(q, dims, traditional=False, base=self.rope_base, scale=1.0, offset=0)
        k = mx.fast.rope(k, dims, traditional=False, base=self.rope_base, scale=1.0, offset=0)
        if self.n_heads != self.n_kv_heads:
            k = mx.repeat(k, self.n_heads // self.n_kv_heads, axis=1)
            v = mx.repeat(v, self.n_heads // self.n_kv_heads, axis=1)
        scores = (q @ k.transpose(0, 1, 3, 2)) * self.scale
        scores = mx.tanh(scores / self.softcap) * self.softcap
        scores = mx.where(mask[:, None, None, :], scores, -1e30)
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
        return self.o_proj((probs @ v).transpose(0, 2, 1, 3).reshape(n, length, -1))


@dataclass
class CharEncoderLayer:
    self_attn: CharSelfAttention
    mlp: GatedMLP
    pre_self_attn_layernorm: OffsetRMSNorm
    post_self_attn_layernorm: OffsetRMSNorm
    pre_feedforward_layernorm: OffsetRMSNorm
    post_feedforward_layernorm: OffsetRMSNorm

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = x + self.post_self_attn_layernorm(self.self_attn(self.pre_self_attn_layernorm(x), mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


@dataclass
class CharAwareSubwordEncoder:
    embed_tokens: Embedding
    layers: list[CharEncoderLayer]
    norm: OffsetRMSNorm
    proj_embedding: Linear
    cont_emb: Embedding
    is_continuation: mx.array  # (vocab + 1,) int32
    cont_pad: mx.array  # scalar int32: the index out-of-vocabulary ids read
    special_emb: Embedding
    special_flags: mx.array  # (vocab,) int32
    special_pad: mx.array
    hidden_size: int

    @classmethod
    def from_weights(cls, weights: Weights, path: str, config: CharacterEncoderConfig) -> CharAwareSubwordEncoder:
        eps = config.rms_norm_eps
        layers = []
        for i in range(config.num_hidden_layers):
            p = f"{path}.backbone.encoder.layers.{i}"
            attn = CharSelfAttention(
                *(Linear.from_weights(weights, f"{p}.self_attn.{n}") for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                n_heads=config.num_attention_heads,
                n_kv_heads=config.num_key_value_heads,
                scale=config.query_pre_attn_scalar**-0.5,
                softcap=config.attn_logit_softcapping,
                rope_base=config.rope_base,
            )
            norms = [OffsetRMSNorm.from_weights(weights, f"{p}.{n}", eps) for n in (
                "pre_self_attn_layernorm", "post_self_attn_layernorm",
                "pre_feedforward_layernorm", "post_feedforward_layernorm")]
            layers.append(CharEncoderLayer(attn, GatedMLP.from_weights(weights, f"{p}.mlp"), *norms))
        embed = Embedding.from_weights(weights, f"{path}.embed_tokens")
        if embed.num_embeddings != config.char_vocab_size:
            raise ValueError(f"{path}.embed_tokens has {embed.num_embeddings} rows, config says "
                             f"char_vocab_size {config.char_vocab_size}")
        return cls(
            embed_tokens=embed,
            layers=layers,
            norm=OffsetRMSNorm.from_weights(weights, f"{path}.backbone.encoder.norm", eps),
            proj_embedding=Linear.from_weights(weights, f"{path}.proj_embedding"),
            cont_emb=Embedding.from_weights(weights, f"{path}.subword_flag_emb.cont_emb"),
            is_continuation=weights.get(f"{path}.subword_flag_emb.is_continuation"),
            cont_pad=weights.get(f"{path}.subword_flag_emb.pad_tensor"),
            special_emb=Embedding.from_weights(weights, f"{path}.bos_eos_emb.special_emb"),
            special_flags=weights.get(f"{path}.bos_eos_emb.special_flags"),
            special_pad=weights.get(f"{path}.bos_eos_emb.pad_tensor"),
            hidden_size=config.hidden_size,
        )

    @property
    def vocab_size(self) -> int:
        """Ids the flag tables know; larger ids read the pad entries."""
        return self.special_flags.shape[0]

    def encode_chars(self, chars: mx.array, lengths: mx.array) -> mx.array:
        """chars: (N, L) int32, lengths: (N,) -> (N, out) projected mean-pooled character states (bf16)."""
        mask = mx.arange(chars.shape[1])[None, :] < lengths[:, None]
        x = self.embed_tokens(chars)
        x = x * mx.array(math.sqrt(self.hidden_size), dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, mask)
        x = self.norm(x)
        pooled = mx.sum(x * mask[..., None], axis=1) / mx.maximum(lengths[:, None], 1)
        return self.proj_embedding(pooled)

    def __call__(self, ids: mx.array, mask: mx.array, table: CharTable) -> mx.array:
        """ids: (B, T) int32, mask: (B, T) bool (positions to condition) -> (B, T, out). Reads both back to
        the host to find each id's characters; `embed_known` takes ids the host already has."""
        return self.embed_known(ids, ids.reshape(-1).tolist(), mask.reshape(-1).tolist(), table)

    def embed_known(self, ids: mx.array, flat_ids: list[int], flat_mask: list[bool], table: CharTable) -> mx.array:
        """`__call__` with the ids and mask also given as flat host lists (row-major), so nothing is read back."""
        b, t = ids.shape
        dtype = self.embed_tokens(mx.array([0])).dtype
        out = mx.zeros((b, t, self.proj_embedding.out_features), dtype=dtype)
        where = [i for i, keep in enumerate(flat_mask) if keep]
        prepared = table.batch([flat_ids[i] for i in where]) if where else None
        if prepared is not None:
            projected = self.encode_chars(*prepared)
            rows = mx.array([i // t for i in where], mx.int32)
            cols = mx.array([i % t for i in where], mx.int32)
            out = out.at[rows, cols].add(projected)
        cont = mx.where(ids >= self.is_continuation.shape[0] - 1, self.cont_pad, ids)
        out = out + self.cont_emb(self.is_continuation[cont])
        special = mx.where(ids >= self.special_flags.shape[0], self.special_pad, ids)
        return out + self.special_emb(self.special_flags[special])

    def embed_rows(self, ids: list[int], table: CharTable) -> mx.array:
        """`embed_known` of N single ids, (N, 1, out), each row as that id's own (1, 1) call computes it.

        Ids are encoded in groups of equal character count, so no row is padded (padding would change the
        attention and pooling sums); one character-encoder pass per distinct length.
        """
        column = mx.array(ids, mx.int32)[:, None]
        dtype = self.embed_tokens(mx.array([0])).dtype
        out = mx.zeros((len(ids), 1, self.proj_embedding.out_features), dtype=dtype)
        groups: dict[int, list[int]] = {}
        for row, i in enumerate(ids):
            groups.setdefault(len(table.subword_chars.get(i, ())), []).append(row)
        for length, rows in sorted(groups.items()):
            if length == 0:
                continue
            chars, lengths = table.batch([ids[r] for r in rows])
            projected = self.encode_chars(chars, lengths)
            out = out.at[mx.array(rows, mx.int32), mx.zeros((len(rows),), mx.int32)].add(projected)
        cont = mx.where(column >= self.is_continuation.shape[0] - 1, self.cont_pad, column)
        out = out + self.cont_emb(self.is_continuation[cont])
        special = mx.where(column >= self.special_flags.shape[0], self.special_pad, column)
        return out + self.special_emb(self.special_flags[special])
