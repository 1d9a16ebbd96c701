"""Chat completion models: vLLM's request plus omni output modalities, diffusion fields and per-stage params."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ModelWrapValidatorHandler, ValidationError, model_validator
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    ChatMessage,
)

from vllm_omni.entrypoints.openai.protocol.common import DiffusionFields, field_path, tagged_error
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import PRIORITY_RANGE

Modality = Literal["text", "audio", "image", "video"]
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_messages(messages: Any, param: str = "messages") -> None:
    """The shape vLLM's own validators assume (they fail with TypeError otherwise): a list of objects, each with
    an OpenAI role and string, list or null content."""
    if not isinstance(messages, list):
        raise OmniClientError(f"{param} must be a list of message objects", param=param)
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise OmniClientError(f"{where} must be an object with role and content", param=where)
        if message.get("role") not in ROLES:
            raise OmniClientError(f"{where}.role must be one of {list(ROLES)}, got {message.get('role')!r}",
                                  param=f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise OmniClientError(f"{where}.content must be a string or a list of parts", param=f"{where}.content")
        if isinstance(content, list) and not all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                                 for p in content):
            raise OmniClientError(f"{where}.content parts must be objects with a type", param=f"{where}.content")


def materialize_content(messages: list[Any], raw: list[Any], param: str = "messages") -> None:
    """Each validated message's content as a list: vLLM's message types validate list content lazily, while it
    is read, so its errors would surface later without the path of the part (`0.ChatCompletionContentPart...`)."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if content is None or isinstance(content, str | list):
            continue
        try:
            message["content"] = list(content)
        except ValidationError as exc:
            error = tagged_error(exc.errors())
            where = f"{param}[{i}].content{field_path(raw[i]['content'], error['loc'])}"
            raise OmniClientError(f"{where}: {error['msg']}", param=where) from None


class OmniChatFields(DiffusionFields):
    """Fields shared by the single and the batched chat request: output modalities, per-stage params and the
    diffusion extra-body fields."""

    modalities: list[Modality] | None = None
    """Output modalities wanted; None = everything the pipeline produces."""
    audio: dict[str, Any] | None = None
    """OpenAI audio output params: {"voice": ..., "format": "wav" | "pcm16"}."""
    sampling_params_list: list[dict[str, Any]] | None = None
    """Per-stage sampling params (one dict per stage, in stage order); overrides the other fields."""
    priority: int = Field(default=0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    """vLLM's chat field (its default, not the diffusion knobs' None), also the diffusion stages' priority."""


class OmniChatCompletionRequest(OmniChatFields, ChatCompletionRequest):
    @model_validator(mode="before")
    @classmethod
    def _check_messages(cls, data: Any) -> Any:
        if isinstance(data, dict) and "messages" in data:
            check_messages(data["messages"])
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _materialize_content(cls, data: Any, handler: ModelWrapValidatorHandler) -> OmniChatCompletionRequest:
        request = handler(data)
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            materialize_content(request.messages, data["messages"])
        return request


class OmniBatchChatCompletionRequest(OmniChatFields, BatchChatCompletionRequest):
    """N conversations sharing one set of request fields (any field of a single chat request)."""

    stream: bool | None = False
    """Accepted for symmetry with chat; batch responses are never streamed."""

    known_models = (OmniChatCompletionRequest,)  # every single-chat field applies to each conversation

    @model_validator(mode="before")
    @classmethod
    def _check_conversations(cls, data: Any) -> Any:
        if isinstance(data, dict) and "messages" in data:
            conversations = data["messages"]
            if not isinstance(conversations, list):
                raise OmniClientError("messages must be a list of conversations", param="messages")
            for i, conversation in enumerate(conversations):
                check_messages(conversation, f"messages[{i}]")
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

