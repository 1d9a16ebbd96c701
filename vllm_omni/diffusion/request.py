"""A diffusion request as the runtime sees it (after the entry point parsed it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_omni.inputs.data import OmniDiffusionSamplingParams

DiffusionPrompt = str | dict[str, Any]
"""A plain prompt, or {"prompt": str, "negative_prompt"?: str, "multi_modal_data"?: {"image": PIL | [PIL]}}."""


@dataclass
class OmniDiffusionRequest:
    prompt: DiffusionPrompt
    sampling_params: OmniDiffusionSamplingParams
    request_id: str

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else str(self.prompt.get("prompt", ""))

    @property
    def negative_prompt(self) -> str | None:
        if isinstance(self.prompt, dict) and self.prompt.get("negative_prompt") is not None:
            return self.prompt["negative_prompt"]
        return self.sampling_params.negative_prompt

    @property
    def multi_modal_data(self) -> dict[str, Any]:
        return dict(self.prompt.get("multi_modal_data") or {}) if isinstance(self.prompt, dict) else {}
