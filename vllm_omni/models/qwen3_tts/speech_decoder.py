"""Qwen3-TTS speech-tokenizer decoder as a GENERATION-stage model: codec chunks in, waveform chunks out.

The checkpoint's `speech_tokenizer/` is the 12 Hz tokenizer (a Mimi encoder, unused for synthesis, and this
decoder). The decoder turns G codebooks per frame into 1920 samples at 24 kHz: residual-VQ lookup (the first
codebook and the rest through separate output projections), a causal conv, a sliding-window transformer, two
transposed-conv + ConvNeXt upsamplers and the SnakeBeta / dilated-conv vocoder. The transformer, ConvNeXt,
residual units and SnakeBeta are transformers' Qwen3-Omni Code2Wav layers (the same blocks) at this decoder's
widths; the quantizer, the transformer's in/out projections and the transposed convs (trimmed on the right only,
where Qwen3-Omni's trim both sides) are this file's. Like Qwen3-Omni's vocoder it looks ahead within a chunk, so
each chunk (with its left context, `CodecChunk`) is decoded on its own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vllm_omni.models.qwen3_omni.stage_input_processors import CodecChunk

SAMPLE_RATE = 24000


class _Codebook(nn.Module):
    """One VQ codebook stored as running sums (`embedding_sum / cluster_usage` is the code's vector)."""

    def __init__(self, dim: int, size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        table = self.embedding_sum / self.cluster_usage.clamp(min=self.eps)[:, None]
        return nn.functional.embedding(codes, table)


class _VQ(nn.Module):
    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self._codebook = _Codebook(dim, size)


class _VQStack(nn.Module):
    def __init__(self, count: int, dim: int, size: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VQ(dim, size) for _ in range(count))


class _ResidualVQ(nn.Module):
    """Sum of the codebooks' vectors, then a 1x1 conv to the output width (`input_proj` only encodes)."""

    def __init__(self, count: int, dim: int, size: int, width: int) -> None:
        super().__init__()
        self.vq = _VQStack(count, dim, size)
        self.input_proj = nn.Conv1d(width, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, width, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, K, T) codes -> (B, width, T)."""
        summed = sum(layer._codebook(codes[:, k]) for k, layer in enumerate(self.vq.layers))
        return self.output_proj(summed.transpose(1, 2))


class _Quantizer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim, size, width = config["codebook_dim"] // 2, config["codebook_size"], config["codebook_dim"]
        self.rvq_first = _ResidualVQ(1, dim, size, width)
        self.rvq_rest = _ResidualVQ(config["num_quantizers"] - 1, dim, size, width)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


class _CausalTransConv(nn.Module):
    """Transposed conv trimmed on the right only (Qwen3-Omni's trims both sides): T frames -> T * stride."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.right_pad = kernel_size - stride

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.conv(hidden)
        return hidden[..., : hidden.shape[-1] - self.right_pad].contiguous()


class _DecoderBlock(nn.Module):
    """SnakeBeta, an upsampling transposed conv, three dilated residual units (Qwen3-Omni's)."""

    def __init__(self, in_dim: int, out_dim: int, rate: int) -> None:
        super().__init__()
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni

        self.block = nn.ModuleList(
            [
                omni.Qwen3OmniMoeSnakeBeta(in_dim),
                _CausalTransConv(in_dim, out_dim, 2 * rate, rate),
                *(omni.Qwen3OmniMoeCode2WavDecoderResidualUnit(out_dim, d) for d in (1, 3, 9)),
            ]
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            hidden = layer(hidden)
        return hidden


def _code2wav_config(config: dict):
    """transformers' Qwen3-Omni Code2Wav config with this decoder's transformer sizes (its width `hidden_size`)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

    keys = (
        "codebook_size",
        "hidden_size",
        "max_position_embeddings",
        "num_attention_heads",
        "num_key_value_heads",
        "attention_bias",
        "sliding_window",
        "intermediate_size",
        "hidden_act",
        "layer_scale_initial_scale",
        "rms_norm_eps",
        "num_hidden_layers",
        "num_quantizers",
        "upsample_rates",
        "upsampling_ratios",
        "decoder_dim",
        "attention_dropout",
    )
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    return Qwen3OmniMoeCode2WavConfig(rope_parameters=rope, **{k: config[k] for k in keys if k in config})


class Qwen3TTSSpeechDecoder(nn.Module):
    """The checkpoint's `speech_tokenizer/` decoder; parameter names are those under its `decoder.` prefix."""

    output_modality = "audio"

    def __init__(self, config: dict) -> None:
        """`config` is `speech_tokenizer/config.json`'s `decoder_config`."""
        super().__init__()
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as omni

        code2wav = _code2wav_config(config)
        latent = config["latent_dim"]
        self.num_quantizers = int(config["num_quantizers"])
        self.codebook_size = int(config["codebook_size"])
        self.quantizer = _Quantizer(config)
        self.pre_conv = omni.Qwen3OmniMoeCausalConvNet(config["codebook_dim"], latent, kernel_size=3)
        self.pre_transformer = omni.Qwen3OmniMoeCode2WavTransformerModel._from_config(code2wav)
        self.pre_transformer.input_proj = nn.Linear(latent, code2wav.hidden_size)
        self.pre_transformer.output_proj = nn.Linear(code2wav.hidden_size, latent)
        self.upsample = nn.ModuleList(
            nn.ModuleList([_CausalTransConv(latent, latent, factor, factor), omni.Qwen3OmniMoeConvNeXtBlock(latent)])
            for factor in config["upsampling_ratios"]
        )
        rates = config["upsample_rates"]
        blocks: list[nn.Module] = [omni.Qwen3OmniMoeCausalConvNet(latent, config["decoder_dim"], 7)]
        dim = config["decoder_dim"]
        blocks += [_DecoderBlock(dim // 2**i, dim // 2 ** (i + 1), rate) for i, rate in enumerate(rates)]
        out_dim = config["decoder_dim"] // 2 ** len(rates)
        blocks += [omni.Qwen3OmniMoeSnakeBeta(out_dim), omni.Qwen3OmniMoeCausalConvNet(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(blocks)
        self.samples_per_frame = int(np.prod([*rates, *config["upsampling_ratios"]]))
        self.sample_rate = SAMPLE_RATE
        self.stage_durations: dict[str, float] = {}

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> Qwen3TTSSpeechDecoder:
        from safetensors import safe_open

        folder = Path(model_dir) / "speech_tokenizer"
        config = json.loads((folder / "config.json").read_text())
        model = cls(config["decoder_config"])
        params = dict(model.named_parameters())
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            names = [n.removeprefix("decoder.") for n in f.keys() if n.startswith("decoder.")]  # noqa: SIM118
            missing = sorted(set(params) - set(names))
            if missing:
                raise ValueError(f"{folder}: the decoder lacks weights {missing[:8]}")
            for name in names:
                if name not in params:
                    raise ValueError(f"{folder}: unexpected decoder weight {name!r}")
                params[name].data.copy_(f.get_tensor("decoder." + name))
        return model.to(device=device, dtype=dtype).eval()

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, G, T) codes -> (B, 1, T * samples_per_frame) waveform in [-1, 1]."""
        hidden = self.pre_conv(self.quantizer(codes)).transpose(1, 2)
        hidden = self.pre_transformer.input_proj(hidden)
        hidden = self.pre_transformer(inputs_embeds=hidden).last_hidden_state
        hidden = self.pre_transformer.output_proj(hidden).permute(0, 2, 1)
        for upsample in self.upsample:
            for block in upsample:
                hidden = block(hidden)
        for block in self.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)

    @torch.inference_mode()
    def forward(self, chunks: list[CodecChunk]) -> list[np.ndarray]:
        """One float32 waveform per chunk (its own frames' samples, context dropped), in input order."""
        start = time.perf_counter()
        device = self.pre_conv.conv.weight.device
        out = []
        for chunk in chunks:
            self._validate(chunk)
            codes = torch.tensor([chunk.codes], dtype=torch.long, device=device)
            out.append(self.decode(codes)[0, 0].float().cpu().numpy()[chunk.context * self.samples_per_frame :])
        self.stage_durations = {"speech_decoder": time.perf_counter() - start}
        return out

    def _validate(self, chunk: CodecChunk) -> None:
        if len(chunk.codes) != self.num_quantizers or not chunk.codes[0]:
            raise ValueError(
                f"codec chunk {chunk.index}: expected {self.num_quantizers} non-empty codebooks, got {len(chunk.codes)}"
            )
        if len({len(g) for g in chunk.codes}) != 1:
            raise ValueError(f"codec chunk {chunk.index}: codebooks have different lengths")
        if not 0 <= chunk.context < len(chunk.codes[0]):
            raise ValueError(f"codec chunk {chunk.index}: context {chunk.context} out of range")
        flat = [c for g in chunk.codes for c in g]
        if min(flat) < 0 or max(flat) >= self.codebook_size:
            raise ValueError(f"codec chunk {chunk.index}: codes must be in [0, {self.codebook_size})")
