"""FLUX.2 [dev]: the klein pipeline with Mistral Small 3 as prompt encoder and embedded (distilled) guidance.

Numerically diffusers' `Flux2Pipeline`: the prompt under FLUX.2's system message through the processor's chat
template, padded to `max_sequence_length`, hidden states of Mistral layers 10, 20 and 30 side by side; guidance is
an input of the transformer (one forward per step, no CFG rows). Defaults are diffusers' (50 steps, guidance 4).
Only the processor's tokenizer is read: prompts are text (prompt upsampling with images is not offered).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion.model_loader.components import load_native_transformer
from vllm_omni.diffusion.model_loader.dummy import load_pretrained
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.errors import OmniClientError
from vllm_omni.models.flux2.pipeline import Flux2KleinPipeline
from vllm_omni.models.flux2.transformer import Flux2Transformer2DModel

if TYPE_CHECKING:
    from vllm_omni.diffusion.data import OmniDiffusionConfig

TEXT_LAYERS = (10, 20, 30)


class Flux2Pipeline(Flux2KleinPipeline):
    progress_desc = "FLUX.2 denoise"

    @classmethod
    def from_pretrained(
        cls, od_config: OmniDiffusionConfig, model_dir: Path, device: torch.device, dtype: torch.dtype
    ) -> Flux2Pipeline:
        from diffusers import AutoencoderKLFlux2
        from transformers import AutoTokenizer, Mistral3ForConditionalGeneration

        model_dir = Path(model_dir)
        load = functools.partial(load_pretrained, device=device, dtype=dtype, load_format=od_config.load_format)
        return cls(
            od_config=od_config,
            transformer=load_native_transformer(
                Flux2Transformer2DModel, model_dir, "transformer", od_config, device, dtype
            ),
            text_encoder=load(Mistral3ForConditionalGeneration, model_dir / "text_encoder"),
            tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
            vae=load(AutoencoderKLFlux2, model_dir / "vae"),
            scheduler_config=json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text()),
            is_distilled=False,
            device=device,
            dtype=dtype,
        )

    @property
    def default_steps(self) -> int:
        return 50

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        if request.negative_prompt is not None:
            raise OmniClientError(
                "negative_prompt is not a FLUX.2 [dev] parameter: its guidance is embedded (guidance_scale), "
                "there is no CFG pass",
                param="negative_prompt",
            )
        return super().group_key(request)

    @torch.inference_mode()
    def encode_texts(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """(B, max_sequence_length, 3 * hidden): Mistral layers 10, 20, 30 of each padded, system-prompted prompt."""
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        messages = [
            [
                {"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                {"role": "user", "content": [{"type": "text", "text": p.replace("[IMG]", "")}]},
            ]
            for p in prompts
        ]
        tokens = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=max_sequence_length,
        )
        out = self.text_encoder(
            input_ids=tokens["input_ids"].to(self.device),
            attention_mask=tokens["attention_mask"].to(self.device),
            output_hidden_states=True,
            use_cache=False,
        )
        return torch.stack([out.hidden_states[k] for k in TEXT_LAYERS], dim=2).flatten(2).to(self.dtype)
