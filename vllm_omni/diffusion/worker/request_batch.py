"""The unit a pipeline's `forward` receives: requests the scheduler found compatible."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_omni.diffusion.request import DiffusionPrompt, OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@dataclass
class DiffusionRequestBatch:
    requests: list[OmniDiffusionRequest]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompts(self) -> list[DiffusionPrompt]:
        return [r.prompt for r in self.requests]

    @property
    def sampling_params(self) -> OmniDiffusionSamplingParams:
        """Shared sampling params (the scheduler only co-batches requests whose keys agree)."""
        return self.requests[0].sampling_params

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]
