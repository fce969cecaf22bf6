"""EAR-TTS: code embedding, gated audio/text fusion with classifier-free guidance, warm-up, per-step codes.

All functions of weights and inputs; the per-session state (caches, key, previous code) lives in the caller:

    caches = tts.backbone.make_caches()
    tts.warmup(prompt_codes, prompt_latent, pad_id, table, caches)        # prompt_codes: (1, P, Q)
    codes = tts.step(previous_code, text_id, table, caches, rng)          # (1, 1, Q) -> (1, 1, Q)

Several sessions' frames run as one batch through `services.tts.step.CompiledStep`, which compiles these same
ops; `step` is the plain path of one session it is tested against.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from services.common.cache import FullCache, RingCache
from services.common.checkpoint import Weights
from services.common.config import TTSConfig
from services.common.layers import Linear
from services.tts.backbone import Gemma3Backbone
from services.tts.blocks import OffsetRMSNorm
from services.tts.mog import MoGHead
from services.tts.rng import BatchKeySequence, KeySequence, SessionKey
from services.tts.subword import CharAwareSubwordEncoder, CharTable

Caches = list[FullCache | RingCache]


def mask_schedule(num_quantizers: int, iterations: int, exponent: float) -> list[int]:
    """Codebooks filled per iteration: masked_i = ceil((1 - (i/n)^e)^(1/e) * Q), counts = masked_i - masked_i+1.

    >>> mask_schedule(31, 8, 3.0)
    [0, 0, 0, 1, 1, 3, 4, 22]
    """
    masked = [math.ceil(((1.0 - (i / iterations) ** exponent) ** (1.0 / exponent)) * num_quantizers)
              for i in range(iterations)]
    return [masked[i] - (masked[i + 1] if i + 1 < iterations else 0) for i in range(iterations)]


@dataclass
class GatedFusion:
    """final_norm(sigmoid(s) * (g * audio_proj(audio / Q) + (1 - g) * text_proj(text))), g = sigmoid(gate)."""

    audio_proj: Linear
    text_proj: Linear
    gate: mx.array
    residual_scale: mx.array
    final_norm: OffsetRMSNorm
    num_codebooks: int

    @classmethod
    def from_weights(cls, weights: Weights, path: str, num_codebooks: int, eps: float) -> GatedFusion:
        return cls(Linear.from_weights(weights, f"{path}.audio_proj"),
                   Linear.from_weights(weights, f"{path}.text_proj"),
                   weights.get(f"{path}.gate"), weights.get(f"{path}.residual_scale"),
                   OffsetRMSNorm.from_weights(weights, f"{path}.final_norm", eps), num_codebooks)

    def __call__(self, audio: mx.array, text: mx.array) -> mx.array:
        """audio, text: (B, T, D) -> (B, T, D)."""
        audio = self.audio_proj(audio / self.num_codebooks)
        text = self.text_proj(text)
        gate = mx.sigmoid(self.gate).astype(audio.dtype)
        scale = mx.sigmoid(self.residual_scale).astype(audio.dtype)
        return self.final_norm(scale * (gate * audio + (1.0 - gate) * text))


@dataclass
class EarTts:
    config: TTSConfig
    backbone: Gemma3Backbone
    embed_code: Linear
    embed_subword: CharAwareSubwordEncoder
    fusion: GatedFusion
    mog_head: MoGHead
    # The codebook tables below are kept in float32, the dtype every use of them computes in (the stored bf16
    # values, converted once at load rather than by every frame: exact, and about 130 MB at the real size).
    books: list[mx.array]  # Q codebooks, each (K, latent) and its own array (no per-frame indexing)
    book_norms: list[mx.array]  # Q arrays (K,): ||e||^2 of every codebook row, summed in the codebooks' dtype
    code_rows: mx.array  # (Q * (K + 1), latent): each codebook's rows then a zero row (the mask index K)
    code_starts: mx.array  # (Q,) int32: q * (K + 1), where codebook q starts in code_rows
    picked_starts: mx.array  # the same (Q,) as uint32, argmin's dtype: the refinement's codes add them as they are
    bos_emb: mx.array
    null_emb: mx.array

    @classmethod
    def from_weights(cls, weights: Weights, path: str, config: TTSConfig) -> EarTts:
        q, k, latent = config.num_quantizers, config.codebook_size, config.latent_size
        rvq = weights.get(f"{path}.rvq_embs", (q, k, latent))
        table = mx.concatenate([rvq, mx.zeros((q, 1, latent), dtype=rvq.dtype)], axis=1)
        norms = mx.sum(rvq * rvq, axis=-1)
        return cls(
            config=config,
            backbone=Gemma3Backbone.from_weights(weights, f"{path}.backbone", config),
            embed_code=Linear.from_weights(weights, f"{path}.embed_code"),
            embed_subword=CharAwareSubwordEncoder.from_weights(weights, f"{path}.embed_subword",
                                                               config.character_encoder),
            fusion=GatedFusion.from_weights(weights, f"{path}.gated_fusion_audio_text", q, config.rms_norm_eps),
            mog_head=MoGHead.from_weights(weights, f"{path}.mog_head", config.mog_head),
            books=[rvq[n].astype(mx.float32) for n in range(q)],
            book_norms=[norms[n].astype(mx.float32) for n in range(q)],
            code_rows=table.reshape(q * (k + 1), latent).astype(mx.float32),
            code_starts=mx.arange(0, q * (k + 1), k + 1, dtype=mx.int32),
            picked_starts=mx.arange(0, q * (k + 1), k + 1, dtype=mx.uint32),
            bos_emb=weights.get(f"{path}.bos_emb", (config.hidden_size,)),
            null_emb=weights.get(f"{path}.null_emb", (config.hidden_size,)),
        )

    def depth_sum(self, codes: mx.array) -> mx.array:
        """codes: (..., Q) int with K = mask -> (..., latent) float32 sum of each codebook's row (mask adds 0).

        Every codebook's row is gathered at once (one gather of the flattened table); the rows are then added
        one codebook after the other, the order of the sum the reference computes."""
        starts = self.picked_starts if codes.dtype == mx.uint32 else self.code_starts.astype(codes.dtype)
        picked = self.code_rows[codes + starts]  # (..., Q, latent)
        out = mx.zeros((*codes.shape[:-1], self.config.latent_size))
        for q in range(self.config.num_quantizers):
            out = out + picked[..., q, :]
        return out

    def embed_codes(self, codes: mx.array) -> mx.array:
        return self.embed_code(self.depth_sum(codes))

    def fuse_guided(self, code_embed: mx.array, cond: mx.array) -> mx.array:
        """code_embed, cond: (S, T, D) of S sessions -> (2S, T, D) for guidance: row 2i conditioned on session i's
        text embedding, row 2i + 1 on the null embedding, both with its code embedding."""
        null = mx.broadcast_to(self.null_emb, cond.shape).astype(cond.dtype)
        text = mx.stack([cond, null], axis=1).reshape(-1, *cond.shape[1:])
        return self.fusion(mx.repeat(code_embed, 2, axis=0), text)

    def warmup(self, prompt_codes: mx.array, prompt_latent: mx.array, pad_id: int, table: CharTable,
               caches: Caches) -> None:
        """Fill the caches with the speaker prompt. prompt_codes: (1, P, Q); prompt_latent: (1, P, D).

        The audio channel starts at the last prompt frame (its BOS); before it the prompt latents stand in
        for code embeddings. Text is conditioned only on the last two frames (pad ids).
        """
        _, frames, _ = prompt_codes.shape
        shifted = mx.concatenate([mx.zeros_like(prompt_codes[:, :1]), prompt_codes[:, :-1]], axis=1)
        code_embed = self.embed_codes(shifted)
        position = mx.arange(frames)[None]
        bos = position == frames - 1
        code_embed = mx.where((position < frames - 1)[..., None], prompt_latent.astype(code_embed.dtype), code_embed)
        code_embed = code_embed + bos[..., None] * self.bos_emb
        ids = mx.full((1, frames), pad_id, mx.int32)
        text_mask = position >= frames - 2
        self.backbone(self.fuse_guided(code_embed, self.embed_subword(ids, text_mask, table)), caches)

    def step(self, previous_code: mx.array, text_id: int, table: CharTable, caches: Caches,
             rng: SessionKey) -> mx.array:
        """previous_code: (1, 1, Q) -> this frame's codes (1, 1, Q) int32; advances caches and rng."""
        ids = mx.array([[text_id]], mx.int32)
        cond = self.embed_subword.embed_known(ids, [text_id], [True], table)  # the host has the id: no read
        inputs = self.fuse_guided(self.embed_codes(previous_code), cond)
        return self.generate_codes(self.backbone(inputs, caches), rng)

    @property
    def draws(self) -> int:
        """Random draws per frame: the keys a frame's refinement takes from a session's key."""
        return 2 * sum(1 for count in self._schedule() if count)  # a uniform and a normal per MoG call

    def generate_codes(self, hidden: mx.array, rng: SessionKey) -> mx.array:
        """hidden: (2, T, D) cond/uncond -> codes (1, T, Q): masked iterative RVQ refinement.

        Runs as one compiled graph (five MoG calls and 31 codebook picks are hundreds of small ops); the keys
        its draws use are taken from `rng` first, in draw order, so the numbers are those of the plain path."""
        return self._compiled_generate(hidden, rng.take(self.draws))

    def _schedule(self) -> list[int]:
        cfg = self.config
        return mask_schedule(cfg.num_quantizers, cfg.num_iterations, cfg.exponent)

    @functools.cached_property
    def _compiled_generate(self):
        return mx.compile(lambda hidden, keys: self.generate_codes_with(hidden, KeySequence(keys)))

    def generate_codes_with(self, hidden: mx.array, rng: SessionKey | KeySequence | BatchKeySequence
                            ) -> mx.array:
        """The refinement itself, drawing from `rng` (uncompiled: tests compare both paths).

        hidden: (2B, T, D), B cond rows then B uncond rows -> codes (B, T, Q)."""
        cfg = self.config
        half = hidden.shape[0] // 2
        cond, uncond = hidden[:half], hidden[half:]
        # masked codes in argmin's own dtype: picked and masked codes then join with no conversions
        masked = mx.full((*cond.shape[:2], cfg.num_quantizers), cfg.codebook_size, mx.uint32)
        picked: list[mx.array] = []  # (B, T, 1) each, codebook by codebook

        def codes() -> mx.array:
            # the picked codes, then the masked rest: one copy per picked codebook (on a GPU one small kernel
            # each) rather than one per codebook every round
            rest = [masked[..., len(picked):]] if len(picked) < cfg.num_quantizers else []
            return mx.concatenate([*picked, *rest], axis=-1) if picked else masked

        for count in self._schedule():
            if count == 0:
                continue
            embedded = self.embed_codes(codes())
            mu, logs = self.mog_head(mx.concatenate([embedded + cond, embedded + uncond], axis=0), rng,
                                     guidance_scale=cfg.guidance_scale, top_p=cfg.top_p)
            residual = mu + mx.exp(logs) * rng.normal(mu.shape) * cfg.noise_scale
            for q in range(len(picked), len(picked) + count):
                book = self.books[q]
                distance = self.book_norms[q] - 2.0 * (residual @ book.T)
                code = mx.argmin(distance, axis=-1)
                picked.append(code[..., None])
                residual = residual - book[code]
        return codes().astype(mx.int32)
