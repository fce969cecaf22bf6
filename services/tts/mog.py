"""The mixture-of-Gaussians head of EAR-TTS: MLP stack, guidance, top-p, Gumbel-max component, low-rank mean.

    mu, logs = head(x, rng, guidance_scale=0.2, top_p=0.95)   # x: (2B, T, D) cond rows then uncond rows
                                                              # -> mu: (B, T, latent), logs: (B, T, 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from services.common.checkpoint import Weights
from services.common.config import MoGConfig
from services.common.layers import Linear
from services.tts.blocks import GatedMLP, OffsetRMSNorm
from services.tts.rng import SessionKey


def top_p_mask(logits: mx.array, top_p: float) -> mx.array:
    """Logits outside the nucleus set to -inf: a component stays while the mass strictly above it is < top_p.

    The largest component always stays (nothing lies above it). logits: (..., K).
    """
    if top_p >= 1.0:
        return logits
    if not 0.0 < top_p:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    order = mx.argsort(probs, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    keep = mx.put_along_axis(mx.zeros_like(above < top_p), order, above < top_p, axis=-1)
    return mx.where(keep, logits, -float("inf"))


@dataclass
class MoGLayer:
    pre_norm: OffsetRMSNorm
    mlp: GatedMLP
    post_norm: OffsetRMSNorm

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.post_norm(self.mlp(self.pre_norm(x)))


@dataclass
class MoGHead:
    # the per-component projections each frame gathers rows of: kept in float32 by `widen`, a gathered row is
    # not converted before its matmul (the head computes in float32)
    WIDEN = ("proj_mus", "low_mat")

    layers: list[MoGLayer]
    final_norm: OffsetRMSNorm
    proj_logits: Linear
    proj_mus: mx.array  # (P, rank, D) dense
    proj_logs: Linear
    proj_else: Linear
    low_mat: mx.array  # (P, latent, rank)
    min_log_std: float

    @classmethod
    def from_weights(cls, weights: Weights, path: str, config: MoGConfig) -> MoGHead:
        eps = config.eps
        layers = [
            MoGLayer(OffsetRMSNorm.from_weights(weights, f"{path}.mlp_stack.{i}.pre_norm", eps),
                     GatedMLP.from_weights(weights, f"{path}.mlp_stack.{i}.mlp"),
                     OffsetRMSNorm.from_weights(weights, f"{path}.mlp_stack.{i}.post_norm", eps))
            for i in range(config.num_layers)
        ]
        mus = Linear.from_weights(weights, f"{path}.proj_mus").dense_weight()
        return cls(
            layers=layers,
            final_norm=OffsetRMSNorm.from_weights(weights, f"{path}.mlp_stack.{config.num_layers}", eps),
            proj_logits=Linear.from_weights(weights, f"{path}.proj_logits"),
            proj_mus=mus.reshape(config.num_predictions, config.low_rank, -1),
            proj_logs=Linear.from_weights(weights, f"{path}.proj_logs"),
            proj_else=Linear.from_weights(weights, f"{path}.proj_else"),
            low_mat=weights.get(f"{path}.low_mat"),
            min_log_std=config.min_log_std,
        )

    def __call__(self, x: mx.array, rng: SessionKey, *, guidance_scale: float, top_p: float
                 ) -> tuple[mx.array, mx.array]:
        """x: (2B, T, D) with conditional rows first -> (mu (B, T, latent), logs (B, T, 1)).

        Draws one uniform (B, T, P) for the Gumbel choice from `rng`.
        """
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        if guidance_scale > 0.0:
            half = x.shape[0] // 2
            cond, uncond = x[:half], x[half:]
            x = cond + guidance_scale * (cond - uncond)
        b, t, _ = x.shape
        logits = top_p_mask(self.proj_logits(x), top_p)
        gumbel = -mx.log(-mx.log(rng.uniform(logits.shape) + 1e-8) + 1e-8)
        component = mx.argmax(mx.log(mx.softmax(logits.astype(mx.float32), axis=-1)) + gumbel, axis=-1).reshape(-1)
        flat = x.reshape(-1, x.shape[-1])
        low = (self.proj_mus[component] @ flat[..., None]).squeeze(-1)
        mu = (self.low_mat[component] @ low[..., None]).squeeze(-1).reshape(b, t, -1)
        logs = mx.maximum(self.proj_logs(x), self.min_log_std)
        return mu * mx.exp(logs) + self.proj_else(x), logs
