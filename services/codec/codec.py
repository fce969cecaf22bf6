"""The VoiceChat audio codec: STFT front, ConvNeXt encoder, probabilistic residual VQ, ConvNeXt decoder, iSTFT.

Layouts (B batch, N samples, T code frames, Q codebooks, D latent width, S = samples per code frame = 1764):

    encode: waveform (B, N) -> spectrogram (B, N/4, 18) -> latents (B, N/S, D) -> codes (B, N/S, Q) int32
    decode: codes (B, T, Q) -> latents (B, T, D) -> features (B, T*S/4, 18) -> waveform (B, T*S) float32

The modules are pure: weights in, arrays out. Streaming decode keeps its causal context in a `DecodeState`
owned by the caller, so one `Codec` serves any number of sessions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import mlx.core as mx

from services.codec.stft import edge_padding, istft, spectrogram
from services.common.checkpoint import Weights
from services.common.config import CodecConfig

PREFIX = "tts_model.audio_codec."
MAX_MAGNITUDE = 100.0  # the decoder's magnitudes saturate softly at this value
NORM_EPS = 1e-6


# mlx.nn's gelu and softplus are mx.compile'd; a compiled function first run on a worker thread (our engine
# thread) aborts the process at exit under MLX 0.32.4, so we spell out the same ops (bit-identical results).
def gelu(x: mx.array) -> mx.array:
    """Exact (erf) GELU."""
    return x * (1 + mx.erf(x / math.sqrt(2))) / 2


def softplus(x: mx.array) -> mx.array:
    return mx.logaddexp(x, 0)


@dataclass(frozen=True)
class Conv:
    """A 1-D convolution with MLX weights (O, K, I / groups); no padding, optional bias."""

    weight: mx.array
    bias: mx.array | None = None
    stride: int = 1
    groups: int = 1

    def __call__(self, x: mx.array) -> mx.array:
        """x: (B, T, I) -> (B, (T - K) // stride + 1, O)."""
        y = mx.conv1d(x, self.weight, self.stride, 0, 1, self.groups)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class UpConv:
    """A transposed 1-D convolution whose kernel equals its stride: each input frame becomes `stride` frames
    with no overlap, so a stream needs no carry between calls."""

    weight: mx.array  # (O, K, I)
    stride: int

    def __call__(self, x: mx.array) -> mx.array:
        """x: (B, T, I) -> (B, T * stride, O)."""
        return mx.conv_transpose1d(x, self.weight, self.stride, 0, 1, 0, 1)


@dataclass(frozen=True)
class ConvNeXtBlock:
    """Causal ConvNeXt: depthwise conv over the K - 1 previous frames, channel LayerNorm, 4x pointwise MLP
    with exact GELU, residual."""

    index: int  # the block's number across its network, which keys its stream context
    dwconv: Conv
    norm_weight: mx.array
    norm_bias: mx.array
    pwconv1: Conv
    pwconv2: Conv

    @property
    def context(self) -> int:
        """Previous frames the depthwise conv sees (K - 1)."""
        return self.dwconv.weight.shape[1] - 1

    def __call__(self, x: mx.array, left: mx.array | None = None) -> mx.array:
        """x: (B, T, C); left: (B, context, C) frames before x (zeros when None) -> (B, T, C)."""
        if left is None:
            hidden = mx.pad(x, ((0, 0), (self.context, 0), (0, 0)))
        else:
            hidden = mx.concatenate([left, x], axis=1)
        hidden = self.dwconv(hidden)
        mean = mx.mean(hidden, axis=-1, keepdims=True)
        variance = mx.var(hidden, axis=-1, keepdims=True)
        hidden = (hidden - mean) * mx.rsqrt(variance + NORM_EPS) * self.norm_weight + self.norm_bias
        hidden = self.pwconv2(gelu(self.pwconv1(hidden)))
        return x + hidden


def _block(weights: Weights, path: str, index: int, channels: int, kernel: int) -> ConvNeXtBlock:
    def conv(name: str, shape: tuple[int, ...], groups: int = 1) -> Conv:
        return Conv(
            weights.get(f"{path}.{name}.weight", shape), weights.get(f"{path}.{name}.bias", shape[:1]), groups=groups
        )

    return ConvNeXtBlock(
        index=index,
        dwconv=conv("dwconv", (channels, kernel, 1), groups=channels),
        norm_weight=weights.get(f"{path}.norm.weight", (channels,)),
        norm_bias=weights.get(f"{path}.norm.bias", (channels,)),
        pwconv1=conv("pwconv1", (4 * channels, 1, channels)),
        pwconv2=conv("pwconv2", (channels, 1, 4 * channels)),
    )


@dataclass
class DecodeState:
    """One stream's causal context: each decoder block's last K - 1 input frames and the last spectral frames
    the inverse STFT overlaps with. Starts empty (zeros), as the whole-sequence decode's causal padding does."""

    block_tails: dict[int, mx.array] = field(default_factory=dict)
    spec_real: mx.array | None = None  # (B, spec_context, bins)
    spec_imag: mx.array | None = None
    frames_decoded: int = 0

    def arrays(self) -> list[mx.array]:
        """Every cached array (for mx.eval)."""
        tails = list(self.block_tails.values())
        return tails + [a for a in (self.spec_real, self.spec_imag) if a is not None]


def _with_left(tail: mx.array | None, x: mx.array, context: int) -> mx.array:
    """The `context` frames before x (zeros for a fresh stream) followed by x, along axis 1."""
    if tail is None:
        tail = mx.zeros((x.shape[0], context, x.shape[2]), dtype=x.dtype)
    return mx.concatenate([tail, x], axis=1)


class Codec:
    """The codec's weights and its whole-sequence and streaming computations."""

    def __init__(self, config: CodecConfig, encoder: list, decoder: list, means: list[mx.array]):
        self.config = config
        self.encoder_layers = encoder  # Conv | ConvNeXtBlock, in order
        self.decoder_layers = decoder  # UpConv | ConvNeXtBlock | Conv, in order
        self.means = means  # Q codebooks of (codebook_size, D)
        left, _ = edge_padding(config.n_fft, config.hop_length)
        # Spectral frames each side of a chunk that share samples with it through the window.
        self.half_spec_context = math.ceil(left / config.hop_length)

    @property
    def samples_per_frame(self) -> int:
        return self.config.waveform_to_token_ratio

    @classmethod
    def from_weights(cls, weights: Weights, config: CodecConfig) -> Codec:
        """Build from `tts_model.audio_codec.*` tensors (MLX layout, as `Checkpoint.load` gives them)."""
        channels = config.stage_channels
        kernel, per_stage = config.block_kernel_size, config.blocks_per_stage
        enc = f"{PREFIX}encoder.layers"
        encoder: list = [Conv(weights.get(f"{enc}.0.weight", (channels[0], 1, config.stft_channels)))]
        block = 0
        for stage, (width, rate) in enumerate(zip(channels, config.downsample_rates, strict=True)):
            for _ in range(per_stage):
                encoder.append(_block(weights, f"{enc}.{len(encoder)}", block, width, kernel))
                block += 1
            out = channels[stage + 1] if stage + 1 < len(channels) else config.latent_dim
            encoder.append(Conv(weights.get(f"{enc}.{len(encoder)}.weight", (out, rate, width)), stride=rate))

        dec = f"{PREFIX}decoder.layers"
        decoder: list = []
        source, block = config.latent_dim, 0
        for width, rate in zip(reversed(channels), reversed(config.downsample_rates), strict=True):
            decoder.append(UpConv(weights.get(f"{dec}.{len(decoder)}.weight", (width, rate, source)), rate))
            for _ in range(per_stage):
                decoder.append(_block(weights, f"{dec}.{len(decoder)}", block, width, kernel))
                block += 1
            source = width
        decoder.append(Conv(weights.get(f"{dec}.{len(decoder)}.weight", (config.stft_channels, 1, channels[0]))))

        shape = (config.codebook_size, config.latent_dim)
        means = [weights.get(f"{PREFIX}prvq.mus_list.{q}", shape) for q in range(config.num_quantizers)]
        return cls(config, encoder, decoder, means)

    # ---- encode --------------------------------------------------------------------------------------

    def encode_latents(self, waveform: mx.array) -> mx.array:
        """waveform: (B, N) float32 -> latents (B, N // S, D)."""
        spec = spectrogram(waveform, self.config.n_fft, self.config.hop_length)
        x = mx.concatenate([spec.real, spec.imag], axis=-1)  # (B, frames, 18): real bins then imaginary
        for layer in self.encoder_layers:
            x = layer(x)
        return x

    def quantize(self, latents: mx.array) -> mx.array:
        """latents: (B, T, D) -> codes (B, T, Q) int32: per codebook, the mean nearest the residual
        (argmin of |r|^2 - 2 r.m + |m|^2), then subtract it."""
        residual, codes = latents, []
        for means in self.means:
            distances = (
                mx.sum(residual * residual, axis=-1, keepdims=True)
                - 2.0 * (residual @ means.T)
                + mx.sum(means * means, axis=-1)[None, None, :]
            )
            index = mx.argmin(distances, axis=-1)
            codes.append(index)
            residual = residual - means[index]
        return mx.stack(codes, axis=-1).astype(mx.int32)

    def encode(self, waveform: mx.array) -> mx.array:
        """waveform: (B, N) float32 -> codes (B, N // S, Q) int32."""
        return self.quantize(self.encode_latents(waveform))

    # ---- decode --------------------------------------------------------------------------------------

    def dequantize(self, codes: mx.array) -> mx.array:
        """codes: (B, T, Q) -> latents (B, T, D) in the codebooks' dtype, summed codebook by codebook."""
        first = self.means[0]
        latents = mx.zeros((*codes.shape[:2], first.shape[-1]), dtype=first.dtype)
        for q in range(codes.shape[-1]):
            latents = latents + self.means[q][codes[:, :, q]]
        return latents

    def decode_features(self, latents: mx.array, state: DecodeState | None = None) -> mx.array:
        """latents: (B, T, D) -> features (B, T * S / hop, 18); with a state, blocks continue its context."""
        x = latents
        for layer in self.decoder_layers:
            if isinstance(layer, ConvNeXtBlock) and state is not None:
                padded = _with_left(state.block_tails.get(layer.index), x, layer.context)
                state.block_tails[layer.index] = padded[:, padded.shape[1] - layer.context :]
                x = layer(x, padded[:, : layer.context])
            else:
                x = layer(x)
        return x

    def spectrum(self, features: mx.array) -> tuple[mx.array, mx.array]:
        """features: (B, F, 2 * bins) log-magnitude logits then phases -> real, imag (B, F, bins), with the
        DC and Nyquist bins' imaginary parts zeroed."""
        bins = self.config.n_fft // 2 + 1
        logits, phase = features[..., :bins], features[..., bins:]
        magnitude = MAX_MAGNITUDE * mx.exp(-softplus(-logits + math.log(MAX_MAGNITUDE)))
        real = magnitude * mx.cos(phase)
        imag = magnitude * mx.sin(phase)
        zero = mx.zeros_like(imag[..., :1])
        imag = mx.concatenate([zero, imag[..., 1:-1], zero], axis=-1)
        return real, imag

    def decode(self, codes: mx.array) -> mx.array:
        """codes: (B, T, Q) int32 -> waveform (B, T * S) float32."""
        real, imag = self.spectrum(self.decode_features(self.dequantize(codes)))
        return istft(real, imag, self.config.n_fft, self.config.hop_length)

    def decode_step(self, codes: mx.array, state: DecodeState) -> mx.array:
        """codes: (B, T, Q) new frames of a stream -> (B, T * S) float32 samples, continuing `state`.

        The inverse STFT runs over the new spectral frames with the stream's previous 2 * c before them
        (c = ceil(6 / hop) = 2), and c * hop samples are dropped from each end of its output, so each call
        returns exactly T * S samples; the stream's audio lags the whole-sequence decode by c * hop samples."""
        real, imag = self.spectrum(self.decode_features(self.dequantize(codes), state))
        context = 2 * self.half_spec_context
        real = _with_left(state.spec_real, real, context)
        imag = _with_left(state.spec_imag, imag, context)
        state.spec_real = real[:, real.shape[1] - context :]
        state.spec_imag = imag[:, imag.shape[1] - context :]
        samples = istft(real, imag, self.config.n_fft, self.config.hop_length)
        trim = self.half_spec_context * self.config.hop_length
        state.frames_decoded += codes.shape[1]
        return samples[:, trim : samples.shape[1] - trim]

    def stream_step(self, codes: mx.array, tails: list[mx.array], spec: tuple[mx.array, mx.array]
                    ) -> tuple[mx.array, list[mx.array], tuple[mx.array, mx.array]]:
        """`decode_step` as a pure function of a started stream's context: codes (B, T, Q), each decoder
        block's tail (in decoder order) and the spectral context (real, imag) in; samples (B, T * S), the
        tails and the spectral context after these frames out."""
        state = DecodeState(dict(zip(self.decoder_blocks, tails, strict=True)), *spec)
        samples = self.decode_step(codes, state)
        return samples, [state.block_tails[index] for index in self.decoder_blocks], (state.spec_real, state.spec_imag)

    @functools.cached_property
    def decoder_blocks(self) -> list[int]:
        """The decoder's ConvNeXt block indices in order: the order `stream_step` takes their tails in."""
        return [layer.index for layer in self.decoder_layers if isinstance(layer, ConvNeXtBlock)]

    @functools.cached_property
    def compiled_stream_step(self):
        """`stream_step` compiled (traced once per frame count, shared by every stream). A fresh stream's
        first frame runs `decode_step`, which creates the context this step takes."""
        return mx.compile(self.stream_step)
