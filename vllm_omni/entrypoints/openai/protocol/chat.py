"""Chat completion models: vLLM's request plus omni output modalities, diffusion fields and per-stage params."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, model_validator
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatMessage,
)

from vllm_omni.entrypoints.openai.protocol.common import reject_unknown_fields

Modality = Literal["text", "audio", "image", "video"]


class OmniChatFields(BaseModel):
    """Fields shared by the single and the batched chat request."""

    modalities: list[Modality] | None = None
    """Output modalities wanted; None = everything the pipeline produces."""
    audio: dict[str, Any] | None = None
    """OpenAI audio output params: {"voice": ..., "format": "wav" | "pcm16"}."""
    sampling_params_list: list[dict[str, Any]] | None = None
    """Per-stage sampling params (one dict per stage, in stage order); overrides the other fields."""
    # Diffusion extra-body fields (see protocol.common.DiffusionFields).
    size: str | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    cfg_scale: float | None = None
    negative_prompt: str | None = None
    quality: str | None = None
    num_outputs_per_prompt: int | None = None
    num_frames: int | None = None
    fps: int | None = None


class OmniChatCompletionRequest(OmniChatFields, ChatCompletionRequest):
    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        reject_unknown_fields(data, cls)
        return data


class OmniBatchChatCompletionRequest(OmniChatFields, BatchChatCompletionRequest):
    """N conversations sharing one set of request fields (any field of a single chat request)."""

    stream: bool | None = False
    """Accepted for symmetry with chat; batch responses are never streamed."""

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        # Every field of a single chat request is accepted too: it applies to each conversation.
        reject_unknown_fields(data, cls, OmniChatCompletionRequest)
        return data

    def to_omni_chat_request(self, messages: list[Any]) -> OmniChatCompletionRequest:
        known = OmniChatCompletionRequest.model_fields
        data = {k: v for k, v in self.model_dump(exclude={"messages", "stream"}, exclude_none=True).items()
                if k in known}
        data["messages"] = messages
        return OmniChatCompletionRequest.model_validate(data)


class OmniChatMessage(ChatMessage):
    """A chat message whose content may be a list of parts (images from diffusion stages)."""

    content: str | list[dict[str, Any]] | None = None


class OmniDeltaMessage(DeltaMessage):
    """A streamed delta that may carry image parts or an audio payload."""

    content: str | list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None

