"""Qwen3-Omni Code2Wav as a GENERATION-stage model: codec chunks in, waveform chunks out.

The vocoder (a sliding-window transformer, transposed-conv upsamplers and a ConvNet decoder) is transformers'
`Qwen3OmniMoeCode2Wav`, built from the checkpoint's `code2wav_config` and loaded from its `code2wav.*` tensors.
It is not causal at frame granularity (each upsampler looks one frame ahead), so chunks cannot be padded into
one batch; and on CPU a batch of equal-length chunks gives samples ~3e-5 (one 16-bit step) off the same chunks
decoded alone, so a request's audio would depend on what else is in flight and a streamed reply (decoded chunk
by chunk) would differ from the same reply decoded at once. Each chunk is therefore decoded on its own.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vllm_omni.models.qwen3_omni.stage_input_processors import CodecChunk
from vllm_omni.models.qwen3_omni.weights import iter_prefixed_weights, load_into


class Qwen3OmniCode2Wav(nn.Module):
    output_modality = "audio"

    def __init__(self, config) -> None:
        """`config` is the checkpoint's `code2wav_config`."""
        super().__init__()
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav as _Vocoder

        self.config = config
        self.vocoder = _Vocoder._from_config(config)
        self.samples_per_frame = int(self.vocoder.total_upsample)
        self.sample_rate = 24000
        self.stage_durations: dict[str, float] = {}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> Qwen3OmniCode2Wav:
        from transformers import AutoConfig

        model_dir = Path(model_dir)
        model = cls(AutoConfig.from_pretrained(model_dir).code2wav_config).to(device=device, dtype=dtype)
        load_into(model.vocoder, iter_prefixed_weights(model_dir, ("code2wav.",)), strip="code2wav.")
        return model.eval()

    @torch.inference_mode()
    def forward(self, chunks: list[CodecChunk]) -> list[np.ndarray]:
        """One float32 waveform per chunk (its own frames' samples, context dropped), in input order."""
        start = time.perf_counter()
        device = self.vocoder.code_embedding.weight.device
        out = []
        for chunk in chunks:
            self._validate(chunk)
            codes = torch.tensor([chunk.codes], dtype=torch.long, device=device)
            out.append(self.vocoder(codes)[0, 0].float().cpu().numpy()[chunk.context * self.samples_per_frame:])
        self.stage_durations = {"code2wav": time.perf_counter() - start}
        return out

    def _validate(self, chunk: CodecChunk) -> None:
        groups = self.config.num_quantizers
        if len(chunk.codes) != groups or not chunk.codes[0]:
            raise ValueError(f"codec chunk {chunk.index}: expected {groups} non-empty codebooks, "
                             f"got {len(chunk.codes)}")
        if len({len(g) for g in chunk.codes}) != 1:
            raise ValueError(f"codec chunk {chunk.index}: codebooks have different lengths")
        if not 0 <= chunk.context < len(chunk.codes[0]):
            raise ValueError(f"codec chunk {chunk.index}: context {chunk.context} out of range")
        flat = [c for g in chunk.codes for c in g]
        if min(flat) < 0 or max(flat) >= self.config.codebook_size:
            raise ValueError(f"codec chunk {chunk.index}: codes must be in [0, {self.config.codebook_size})")
