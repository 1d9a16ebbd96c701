"""`/v1/chat/completions` on an omni pipeline: text from AR stages, images from diffusion stages and audio
from audio stages, streamed as SSE or returned at once.

Tool calling goes through vLLM's own parsers (`--enable-auto-tool-choice --tool-call-parser NAME`, as with
`vllm serve`): the parser constrains generation for `tool_choice="required"` / a named function and extracts the
calls from the text."""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaToolCall, ToolCall
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.exceptions import VLLMClientError
from vllm.parser import Parser, ParserManager
from vllm.renderers.chat_utils import make_tool_call_id
from vllm.sampling_params import RequestOutputKind
from vllm.utils import random_uuid
from vllm.utils.async_utils import make_async

from openai.types.chat.chat_completion_audio import ChatCompletionAudio
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.entrypoints.openai.audio_stream import AudioDeltas, audio_chunk
from vllm_omni.entrypoints.openai.chat_media import (
    MediaLimits,
    check_media_parts,
    parse_media_messages,
)
from vllm_omni.entrypoints.openai.errors import exception_to_response
from vllm_omni.entrypoints.openai.media import audio_to_pcm16, decode_image_url, encode_wav, image_data_url
from vllm_omni.entrypoints.openai.protocol.chat import (
    OmniChatCompletionRequest,
    OmniChatFields,
    OmniChatMessage,
    OmniDeltaMessage,
)
from vllm_omni.entrypoints.openai.protocol.common import DIFFUSION_FIELD_NAMES, DiffusionFields, named_field
from vllm_omni.entrypoints.openai.serving_base import OmniServingBase, fail_fast, maybe_await, prepend
from vllm_omni.errors import OmniClientError, OmniError
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)

AUDIO_FORMATS = ("wav", "pcm16")
DEFAULT_MAX_TOKENS = 256
AUDIO_TTL_S = 3600


@dataclass
class Completion:
    """One of a text output's `n` completions."""

    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def completions(output: OmniRequestOutput) -> list[Completion]:
    """The completions a text output carries (vLLM streams the `n` completions of a request one at a time)."""
    ro = output.request_output
    if ro is None or not hasattr(ro, "outputs"):
        return [Completion(0, output.text or "")]
    return [Completion(getattr(c, "index", pos), c.text, list(getattr(c, "token_ids", [])),
                       getattr(c, "finish_reason", None)) for pos, c in enumerate(ro.outputs)]


def output_text(output: OmniRequestOutput, index: int = 0) -> str:
    return next((c.text for c in completions(output) if c.index == index), "")


def is_text_output(output: OmniRequestOutput) -> bool:
    return output.request_output is not None or output.final_output_type == "text"


DIFFUSION_CHAT_FIELDS = frozenset(OmniChatFields.model_fields) | {
    "messages", "model", "seed", "stream", "stream_options", "user", "tools", "tool_choice", "request_id"}
"""The chat fields that mean something to a pipeline without an AR stage (tools get their own error)."""

DIFFUSION_ONLY_CHAT_FIELDS = DIFFUSION_FIELD_NAMES - (frozenset(ChatCompletionRequest.model_fields) - {"priority"})
"""The diffusion fields an AR stage does not take: `seed` is vLLM's own chat field too (its sampling seed);
`priority` is vLLM's as well but never reaches an AR stage, so it stays."""

VLLM_CHAT_FIELDS = frozenset({"logprobs", "top_logprobs", "prompt_logprobs", "return_token_ids",
                              "return_tokens_as_token_ids"})
"""Fields whose answer only vLLM's own chat serving builds (on AR-first pipelines it answers them)."""

OMNI_CHAT_FIELDS = (frozenset(OmniChatFields.model_fields) - {"modalities"})
"""Fields only our chat serving understands (per-stage params, audio output, diffusion knobs)."""


def _part_value(part: dict[str, Any], kind: str, param: str) -> str:
    """The text of a text part, the URL of an image_url part ({"url": ...} or the URL itself)."""
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str):
        raise OmniClientError(f"{param}: a {kind} part needs a string {kind}", param=param)
    return value


class OmniOpenAIServingChat(OmniServingBase):
    """Chat completions for any stage graph; the prompt goes to stage 0 (chat template for AR stage 0,
    last user message + its images for a diffusion stage 0)."""

    def __init__(self, *args: Any, chat_template: str | None = None, tool_parser: str | None = None,
                 enable_auto_tools: bool = False, trust_request_chat_template: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template
        self.tool_parser = tool_parser
        self.enable_auto_tools = enable_auto_tools
        self.trust_request_chat_template = trust_request_chat_template
        self._parser_cls: type[Parser] | None = None
        # Template rendering and tokenization are CPU-bound: one worker thread, as vLLM's renderers do, so the
        # event loop keeps answering (/health, other streams) while a large prompt is prepared.
        self._render_async = make_async(self._render, executor=ThreadPoolExecutor(max_workers=1))

    @property
    def starts_with_ar(self) -> bool:
        """Whether stage 0 is an AR (text) model: chat template, tools and n > 1 apply to it."""
        return self.capabilities.starts_with_ar

    @property
    def has_ar_stage(self) -> bool:
        return StageKind.AR in self.capabilities.stage_kinds

    async def create_chat_completion(self, request: OmniChatCompletionRequest, raw_request: Request | None):
        self.check_model(request.model)
        self.check_text_generation_fields(request)
        modalities = self.resolve_modalities(request)
        request, parser = await self.prepare_tools(request, modalities)
        prompt, num_prompt_tokens = await self.build_prompt(request)
        params = self.build_chat_sampling_params(request)
        base_id = self.base_request_id(raw_request)
        request_id = f"chatcmpl-{base_id}"
        if request.stream:
            stream = self.chat_stream(request, modalities, prompt, request_id, params, num_prompt_tokens, parser)
            return StreamingResponse(await fail_fast(stream), media_type="text/event-stream")
        finals = await self.generate_final(prompt, request_id, params, self.requested(request, modalities))
        built = [self.build_choice(request, modalities, finals, index=i, num_prompt_tokens=num_prompt_tokens,
                                   parser=parser) for i in range(request.n or 1)]
        completion_tokens = sum(usage.completion_tokens or 0 for _, usage in built)
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=num_prompt_tokens + completion_tokens)
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=[c for c, _ in built],
                                          usage=usage)
        body = response.model_dump(exclude_none=True)
        if (cache := next((o.cache for o in finals if o.cache is not None), None)) is not None:
            body["cache"] = cache  # vllm-omni extension, as on the images routes: what the diffusion cache ran
        return JSONResponse(body)

    @staticmethod
    def base_request_id(raw_request: Request | None) -> str:
        header = raw_request.headers.get("X-Request-Id") if raw_request is not None else None
        return header or random_uuid()

    # vLLM's own chat ----------------------------------------------------------------------------

    def wants_vllm_chat(self, request: OmniChatCompletionRequest) -> bool:
        """Whether vLLM's chat serving answers `request`: it asks for what only vLLM's chat reports (token
        logprobs, token ids) and the answer is text from AR stage 0. Such a request on an answer with other
        modalities is refused naming the field, never answered without what it asked for."""
        asked = sorted(name for name in VLLM_CHAT_FIELDS & request.model_fields_set if getattr(request, name))
        if not asked:
            return False
        omni = sorted(OMNI_CHAT_FIELDS & request.model_fields_set)
        text_only = self.starts_with_ar and self.resolve_modalities(request) == {"text"} and not omni
        if not text_only:
            reason = f"the omni fields {omni}" if omni else "a text-only answer: pass modalities=['text']"
            raise OmniClientError(f"{asked[0]} needs {reason} (this model outputs "
                                  f"{sorted(self.output_modalities)}; token details exist for AR stage 0's "
                                  "text only)", param=asked[0])
        return True

    # Validation ----------------------------------------------------------------------------------

    def check_text_generation_fields(self, request: OmniChatFields) -> None:
        """Without an AR stage, text-generation fields would be ignored: they are refused, named. So are the
        token details only vLLM's chat reports, when the request reaches this serving instead."""
        asked = sorted(name for name in VLLM_CHAT_FIELDS & request.model_fields_set if getattr(request, name))
        if asked and self.has_ar_stage:
            raise OmniClientError(f"{asked[0]} is answered by vLLM's chat serving for a text-only answer from AR "
                                  "stage 0 of a single conversation", param=asked[0])
        if self.has_ar_stage:
            self.check_stage_fields(request)
            return
        set_fields = request.model_fields_set - DIFFUSION_CHAT_FIELDS
        if request.n == 1:
            set_fields.discard("n")
        if set_fields:
            names = sorted(set_fields)
            raise OmniClientError(f"`{self.model_name}` has no text-generation (AR) stage; these fields do not "
                                  f"apply to it: {names}", param=names[0])

    def check_stage_fields(self, request: OmniChatFields) -> None:
        """Without a diffusion stage the diffusion fields, `priority` included, would be dropped: refused, named.
        (The omni stage path carries no vLLM priority to an AR stage, as on vLLM's own routes:
        `engine_client._REFUSED_DEFAULTS`.)"""
        if StageKind.DIFFUSION in self.capabilities.stage_kinds:
            return
        diffusion = sorted(name for name in DIFFUSION_ONLY_CHAT_FIELDS & request.model_fields_set
                           if getattr(request, name) is not None)
        if request.priority == 0 and "priority" in diffusion:  # vLLM's default, what the OpenAI SDK may send
            diffusion.remove("priority")
        if diffusion:
            raise OmniClientError(f"`{self.model_name}` has no diffusion stage; these fields do not apply to it: "
                                  f"{diffusion} (priority: its AR stages are not given one, leave it 0)",
                                  param=diffusion[0])

    def resolve_modalities(self, request: OmniChatCompletionRequest) -> set[str]:
        modalities = self.requested_modalities(request)
        if request.n is not None and request.n < 1:
            raise OmniClientError(f"n must be >= 1, got {request.n}", param="n")
        if (request.n or 1) > 1:
            if modalities != {"text"} or not self.starts_with_ar:
                raise OmniClientError("n > 1 needs a text-only answer from an AR model; use "
                                      "num_outputs_per_prompt for several images", param="n")
            if request.tools and request.tool_choice != "none":
                raise OmniClientError("n > 1 cannot be combined with tool calling", param="n")
            self.check_num_outputs(request.n, "n")
        return modalities

    def requested_modalities(self, request: OmniChatCompletionRequest) -> set[str]:
        if request.modalities is None:
            return set(self.output_modalities)
        missing = sorted(set(request.modalities) - self.output_modalities)
        if missing:
            raise OmniClientError(
                f"modalities {missing} cannot be produced by `{self.model_name}` "
                f"(it outputs {sorted(self.output_modalities)})",
                param="modalities",
            )
        if "audio" in request.modalities:
            fmt = (request.audio or {}).get("format", "wav")
            if fmt not in AUDIO_FORMATS:
                raise OmniClientError(f"audio.format must be one of {list(AUDIO_FORMATS)}, got {fmt!r}",
                                      param="audio.format")
        return set(request.modalities)

    async def prepare_tools(self, request: OmniChatCompletionRequest, modalities: set[str]
                            ) -> tuple[OmniChatCompletionRequest, Parser | None]:
        """The request as vLLM's tool parser adjusts it (structured output for required / named tool choice),
        and a parser for this request's output; (request, None) when no tool may be called."""
        if not request.tools or request.tool_choice == "none":
            return request, None
        if not self.starts_with_ar:
            raise OmniClientError(f"`{self.model_name}` does not start with a text model: no tool calling",
                                  param="tools")
        if modalities != {"text"}:  # later stages would speak / draw the tool-call markup
            raise OmniClientError(f"tool calling needs a text-only answer: pass modalities=['text'] (this model "
                                  f"outputs {sorted(self.output_modalities)})", param="modalities")
        auto = request.tool_choice in (None, "auto")
        if self.tool_parser is None or (auto and not self.enable_auto_tools):
            flags = "--enable-auto-tool-choice and --tool-call-parser" if auto else "--tool-call-parser"
            raise OmniClientError(f'tool_choice={json.dumps(request.tool_choice or "auto")} requires the server to '
                                  f"be started with {flags}", param="tool_choice")
        tokenizer = await maybe_await(self.engine.get_tokenizer())
        if self._parser_cls is None:
            self._parser_cls = ParserManager.get_parser(tool_parser_name=self.tool_parser,
                                                        enable_auto_tools=self.enable_auto_tools,
                                                        model_name=self.model_name, tokenizer=tokenizer)
        parser = self._parser_cls(tokenizer, request.tools)
        return parser.adjust_request(request), parser

    @staticmethod
    def requested(request: OmniChatCompletionRequest, modalities: set[str]) -> list[str] | None:
        """What the engine must produce: only what the request asked for (text-only skips audio stages)."""
        return None if request.modalities is None else sorted(modalities)

    # Prompt --------------------------------------------------------------------------------------

    async def build_prompt(self, request: OmniChatCompletionRequest) -> tuple[Any, int]:
        if self.starts_with_ar:
            conversation, mm_data = await self.media_conversation(request)
            prompt, num_tokens = await self.templated_prompt(request, conversation)
            fields: dict[str, Any] = {}
            if mm_data:
                fields["multi_modal_data"] = mm_data
                if request.mm_processor_kwargs:
                    fields["mm_processor_kwargs"] = request.mm_processor_kwargs
            voice = (request.audio or {}).get("voice")  # the speaker of an audio stage downstream
            if voice:
                fields["voice"] = voice
            return ({"prompt": prompt, **fields} if fields else prompt), num_tokens
        return await self.diffusion_prompt(request), 0

    async def media_conversation(self, request: OmniChatCompletionRequest
                                 ) -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None]:
        """(conversation, multi_modal_data) parsed by vLLM when the messages carry media parts; (None, None)
        for text-only messages or a text-only model, which keep our own template messages (tool calls
        included; media parts there are refused by `text_only`)."""
        accepted = frozenset(self.capabilities.input_modalities - {"text"})
        limits = MediaLimits.from_server(self.limits)
        if not accepted or not check_media_parts(request.messages, accepted, self.model_name, limits):
            return None, None
        return await parse_media_messages(request.messages, self.engine.model_config, request.mm_processor_kwargs,
                                          limits)

    async def templated_prompt(self, request: OmniChatCompletionRequest,
                               conversation: list[dict[str, Any]] | None = None) -> tuple[str, int]:
        messages = conversation or [self.template_message(m, i) for i, m in enumerate(request.messages)]
        request_template = request.chat_template or (request.chat_template_kwargs or {}).get("chat_template")
        if request_template is not None and not self.trust_request_chat_template:
            raise OmniClientError("a request chat_template is refused unless the server runs with "
                                  "--trust-request-chat-template", param="chat_template")
        tokenizer = await maybe_await(self.engine.get_tokenizer())
        template = request.chat_template or self.chat_template
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise OmniClientError(f"`{self.model_name}` has no chat template; pass chat_template",
                                  param="chat_template")
        return await self._render_async(tokenizer, messages, template, request, self.max_prompt_chars(tokenizer))

    def max_prompt_chars(self, tokenizer: Any) -> int | None:
        """vLLM's bound before tokenizing: no prompt of more characters fits the model's context (tokenizing
        megabytes only to refuse them would hold the GIL for long stretches)."""
        model_config = getattr(self.engine, "model_config", None)
        per_token = getattr(tokenizer, "max_chars_per_token", None)
        if model_config is None or not per_token:
            return None
        return model_config.max_model_len * per_token

    @staticmethod
    def _render(tokenizer: Any, messages: list[dict[str, Any]], template: str | None,
                request: OmniChatCompletionRequest, max_chars: int | None) -> tuple[str, int]:
        """(prompt text, its token count); runs in the render thread."""
        try:
            prompt = tokenizer.apply_chat_template(
                messages, tokenize=False, chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=[tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors, bad kwargs: the request's fault
            raise OmniClientError(f"chat template failed: {exc}", param="messages") from exc
        if max_chars is not None and len(prompt) > max_chars:
            raise OmniClientError(f"the prompt has {len(prompt)} characters, more than the {max_chars} that fit this "
                                  "model's context (--max-model-len)", param="messages")
        return prompt, len(tokenizer.encode(prompt, add_special_tokens=False))

    @classmethod
    def template_message(cls, message: dict[str, Any], index: int) -> dict[str, Any]:
        """What the chat template gets: text content, plus the tool fields of assistant / tool messages
        (arguments as objects, the way HF templates print them)."""
        out = {"role": message["role"], "content": cls.text_only(message, index)}
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                out[key] = message[key]
        if message.get("tool_calls"):
            out["tool_calls"] = [cls.template_tool_call(call) for call in message["tool_calls"]]
        return out

    @staticmethod
    def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            with contextlib.suppress(json.JSONDecodeError):  # otherwise the template prints it as given
                function["arguments"] = json.loads(function["arguments"])
        return {**call, "function": function}

    @staticmethod
    def text_only(message: dict[str, Any], index: int) -> str:
        content = message.get("content")
        if content is None or isinstance(content, str):
            return content or ""
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text":
                where = f"messages[{index}].content[{j}]"
                raise OmniClientError(f"{where}: this model takes text only; only text parts are accepted, got "
                                      f"{part.get('type')!r}", param=where)
            texts.append(part["text"])
        return "\n".join(texts)

    async def diffusion_prompt(self, request: OmniChatCompletionRequest) -> dict[str, Any]:
        """A diffusion stage takes the last user message: its text is the prompt, its images the inputs."""
        users = [(i, m) for i, m in enumerate(request.messages) if m.get("role") == "user"]
        if not users:
            raise OmniClientError("messages must contain a user message", param="messages")
        index, message = users[-1]
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        param = f"messages[{index}].content"
        texts = [_part_value(part, "text", param) for part in parts if part.get("type") == "text"]
        urls = [_part_value(part, "image_url", param) for part in parts if part.get("type") == "image_url"]
        unsupported = [part.get("type") for part in parts if part.get("type") not in ("text", "image_url")]
        if unsupported:
            raise OmniClientError(f"{param}: unsupported content part {unsupported[0]!r}", param=param)
        if urls:
            self.check_accepts_images(param)
        images = [await decode_image_url(url, param, self.limits.max_upload_bytes, self.limits.max_input_image_pixels)
                  for url in urls]
        prompt: dict[str, Any] = {"prompt": "\n".join(texts)}
        if not prompt["prompt"].strip():
            raise OmniClientError(f"messages[{index}] has no text prompt", param=f"messages[{index}].content")
        if request.negative_prompt is not None:
            prompt["negative_prompt"] = request.negative_prompt
        if images and not self.capabilities.accepts_image_input:
            raise OmniClientError(f"`{self.model_name}` does not take input images: it "
                                  f"{self.capabilities.describe()}", param=f"messages[{index}].content")
        if images:
            prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        return prompt

    # Sampling params -----------------------------------------------------------------------------

    def build_chat_sampling_params(self, request: OmniChatCompletionRequest) -> list[Any]:
        fields = DiffusionFields.model_validate(request.model_dump(include=DIFFUSION_FIELD_NAMES, exclude_none=True))
        return self.build_sampling_params_list(
            explicit=request.sampling_params_list,
            diffusion_fields=fields,
            first_llm_params=lambda default: self.llm_params(request, default),
            n=request.n or 1,
        )

    @staticmethod
    def llm_params(request: OmniChatCompletionRequest, default: Any) -> Any:
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is None:
            max_tokens = getattr(default, "max_tokens", None) or DEFAULT_MAX_TOKENS
        try:
            params = request.to_sampling_params(max_tokens, {})
        except (ValueError, VLLMClientError) as exc:
            raise OmniClientError(str(exc), param=getattr(exc, "parameter", None)
                                  or named_field(str(exc), request.model_fields_set)) from exc
        # A stream computes its own deltas from cumulative text, whatever the stage graph emits in between;
        # a plain response needs only the final output.
        params.output_kind = RequestOutputKind.CUMULATIVE if request.stream else RequestOutputKind.FINAL_ONLY
        return params

    # Responses -----------------------------------------------------------------------------------

    def build_choice(self, request: OmniChatCompletionRequest, modalities: set[str],
                     finals: list[OmniRequestOutput], *, index: int, num_prompt_tokens: int,
                     parser: Parser | None = None, completion_index: int | None = None
                     ) -> tuple[ChatCompletionResponseChoice, UsageInfo]:
        """Choice `index` of the answer, made from text completion `completion_index` (default: `index`; a
        batch answers conversation `index` with its only completion, 0)."""
        which = index if completion_index is None else completion_index
        text_out = next((o for o in reversed(finals) if is_text_output(o)), None)
        text = output_text(text_out, which) if text_out is not None and "text" in modalities else None
        completion = self.completion_info(text_out, which)
        tool_calls: list[ToolCall] = []
        finish_reason = completion[1]
        if parser is not None and text is not None:
            text, tool_calls, finish_reason = self.parse_tool_calls(request, parser, text_out, finish_reason)
        images = [img for o in finals for img in o.images] if "image" in modalities else []
        audio_out = next((o for o in finals if "audio" in o.multimodal_output), None)
        message = OmniChatMessage(role="assistant", content=self.content(text, images), tool_calls=tool_calls)
        if audio_out is not None and "audio" in modalities:
            message.audio = ChatCompletionAudio(**self.audio_payload(request, audio_out, transcript=text or ""))
        usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion[0],
                          total_tokens=num_prompt_tokens + completion[0])
        choice = ChatCompletionResponseChoice(index=index, message=message, finish_reason=finish_reason)
        return choice, usage

    def parse_tool_calls(self, request: OmniChatCompletionRequest, parser: Parser, text_out: OmniRequestOutput,
                         finish_reason: str) -> tuple[str | None, list[ToolCall], str]:
        """(content, tool calls, finish reason) of a finished text output, as vLLM's chat server reports them:
        finish_reason "tool_calls" when tools were called under "auto" or "required", "stop" for a named one."""
        ro = text_out.request_output
        token_ids = list(ro.outputs[0].token_ids) if ro is not None and ro.outputs else None
        _, content, calls = parser.parse(output_text(text_out), request, enable_auto_tools=self.enable_auto_tools,
                                         model_output_token_ids=token_ids)
        tool_calls = [ToolCall(id=call.id or make_tool_call_id(), function=call) for call in calls or []]
        if tool_calls and request.tool_choice in (None, "auto", "required"):
            finish_reason = "tool_calls"
        return content, tool_calls, finish_reason

    @staticmethod
    def content(text: str | None, images: list[Any]) -> str | list[dict[str, Any]] | None:
        if not images:
            return text
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        parts += [{"type": "image_url", "image_url": {"url": image_data_url(img)}} for img in images]
        return parts

    @staticmethod
    def completion_info(text_out: OmniRequestOutput | None, index: int = 0) -> tuple[int, str]:
        """(completion tokens, finish reason) of completion `index`."""
        found = next((c for c in completions(text_out) if c.index == index), None) if text_out else None
        if found is None:
            return 0, "stop"
        return len(found.token_ids), found.finish_reason or "stop"

    @staticmethod
    def audio_payload(request: OmniChatCompletionRequest, output: OmniRequestOutput, transcript: str
                      ) -> dict[str, Any]:
        audio = output.multimodal_output["audio"]
        rate = int(output.multimodal_output.get("sample_rate", 24000))
        fmt = (request.audio or {}).get("format", "wav")
        data = encode_wav(audio, rate) if fmt == "wav" else audio_to_pcm16(audio)
        return {"id": f"audio-{random_uuid()}", "data": base64.b64encode(data).decode("ascii"),
                "expires_at": int(time.time()) + AUDIO_TTL_S, "transcript": transcript}

    # Streaming -----------------------------------------------------------------------------------

    async def chat_stream(self, request: OmniChatCompletionRequest, modalities: set[str], prompt: Any,
                          request_id: str, params: list[Any], num_prompt_tokens: int,
                          parser: Parser | None = None) -> AsyncIterator[str]:
        """SSE chunks. With a tool parser the text is held back and sent once parsed, as content and/or
        complete tool calls in one delta (clients accumulate deltas the same way)."""
        created = int(time.time())

        def chunk(delta: OmniDeltaMessage, finish_reason: str | None = None, usage: UsageInfo | None = None,
                  index: int = 0) -> str:
            choices = [] if usage is not None else [
                ChatCompletionResponseStreamChoice(index=index, delta=delta, finish_reason=finish_reason)]
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                choices=choices, usage=usage)
            return f"data: {body.model_dump_json(exclude_none=True)}\n\n"

        outputs = self.generate(prompt, request_id, params, self.requested(request, modalities))
        try:  # nothing is sent before the engine answers: a dead or sleeping engine is the HTTP status (503)
            first = [await anext(outputs)]
        except StopAsyncIteration:
            first = []
        except Exception as exc:
            if isinstance(exc, OmniError) and exc.status_code == 503:
                raise
            yield f"data: {exception_to_response(exc).body.decode()}\n\n"
            yield "data: [DONE]\n\n"
            return
        for index in range(request.n or 1):
            yield chunk(OmniDeltaMessage(role="assistant", content=""), index=index)
        sent: dict[tuple[int, int], int] = {}
        tokens: dict[tuple[int, int], int] = {}
        latest: dict[int, Completion] = {}  # per choice: its completion as last seen
        audio = AudioDeltas((request.audio or {}).get("format", "wav"), AUDIO_TTL_S)
        spoken = ""
        text_out: OmniRequestOutput | None = None
        try:
            async for output in prepend(first, outputs):
                if is_text_output(output):
                    text_out = output
                    for completion in completions(output):
                        key = (output.stage_id, completion.index)
                        delta, sent[key] = completion.text[sent.get(key, 0):], len(completion.text)
                        new_tokens = len(completion.token_ids) > tokens.get(key, 0)
                        tokens[key] = len(completion.token_ids)
                        latest[completion.index] = completion
                        if completion.index == 0:
                            spoken += delta  # what the transcript adds up to: the text as it was streamed
                        # A chunk per engine output with new tokens, as vLLM streams: also when the tokens add no
                        # text yet (the detokenizer holds back an incomplete UTF-8 sequence).
                        if (delta or new_tokens) and "text" in modalities and parser is None:
                            yield chunk(OmniDeltaMessage(content=delta), index=completion.index)
                if output.finished and output.images and "image" in modalities:
                    yield chunk(OmniDeltaMessage(content=self.content(None, output.images)))
                samples = audio_chunk(output)
                if samples is not None and "audio" in modalities:
                    yield chunk(OmniDeltaMessage(audio=audio.delta(output, samples, spoken)))
        except Exception as exc:
            response = exception_to_response(exc)
            yield f"data: {response.body.decode()}\n\n"
            yield "data: [DONE]\n\n"
            return
        if "audio" in modalities and (rest := audio.rest(spoken)) is not None:
            yield chunk(OmniDeltaMessage(audio=rest))
        finish_reasons = {i: (latest[i].finish_reason or "stop") if i in latest else "stop"
                          for i in range(request.n or 1)}
        completion_tokens = sum(len(c.token_ids) for c in latest.values())
        if parser is not None and text_out is not None and "text" in modalities:  # n == 1 with tools
            content, tool_calls, finish_reasons[0] = self.parse_tool_calls(request, parser, text_out,
                                                                           finish_reasons[0])
            deltas = [DeltaToolCall(index=i, id=call.id, type="function",
                                    function=DeltaFunctionCall(name=call.function.name,
                                                               arguments=call.function.arguments))
                      for i, call in enumerate(tool_calls)]
            if content or deltas:
                yield chunk(OmniDeltaMessage(content=content or None, tool_calls=deltas))
        for index, finish_reason in finish_reasons.items():
            yield chunk(OmniDeltaMessage(), finish_reason=finish_reason, index=index)
        if request.stream_options is not None and request.stream_options.include_usage:
            usage = UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                              total_tokens=num_prompt_tokens + completion_tokens)
            yield chunk(OmniDeltaMessage(), usage=usage)
        yield "data: [DONE]\n\n"

