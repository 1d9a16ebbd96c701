"""`/v1/chat/completions/batch`: N conversations in one HTTP request, run concurrently in the engine.

Sub-request ids are `{base}-idx-{i}` (base = the X-Request-Id header when given), the response id is
`chatcmpl-batch-{base}`, choice i answers conversation i, usage is summed; the first failure fails the batch
and cancels (aborts) the sub-requests still running.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
from vllm.entrypoints.serve.engine.protocol import UsageInfo

from vllm_omni.entrypoints.openai.protocol.chat import OmniBatchChatCompletionRequest, OmniChatCompletionRequest
from vllm_omni.entrypoints.openai.serving_chat import OmniOpenAIServingChat
from vllm_omni.errors import OmniClientError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class OmniOpenAIServingChatBatch(OmniOpenAIServingChat):
    @staticmethod
    def get_subrequest_ids(base_id: str, request: OmniBatchChatCompletionRequest) -> list[str]:
        return [f"{base_id}-idx-{i}" for i in range(len(request.messages))]

    async def create_batch_chat_completion(self, request: OmniBatchChatCompletionRequest,
                                           raw_request: Request | None) -> JSONResponse:
        self.check_model(request.model)
        self.check_text_generation_fields(request)
        if request.n not in (None, 1):
            raise OmniClientError("n must be 1 for batch chat (one answer per conversation)", param="n")
        if request.stream:
            logger.warning("Batch chat completions are never streamed; ignoring stream=true")
        base_id = self.base_request_id(raw_request)
        sub_ids = self.get_subrequest_ids(base_id, request)
        sub_requests = [request.to_omni_chat_request(messages) for messages in request.messages]
        tasks = [asyncio.create_task(self.complete_one(sub, sub_id, index))
                 for index, (sub, sub_id) in enumerate(zip(sub_requests, sub_ids, strict=True))]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        usage = UsageInfo()
        for _, sub_usage in results:
            usage.prompt_tokens += sub_usage.prompt_tokens
            usage.completion_tokens = (usage.completion_tokens or 0) + (sub_usage.completion_tokens or 0)
            usage.total_tokens += sub_usage.total_tokens
        response = ChatCompletionResponse(id=f"chatcmpl-batch-{base_id}", model=self.model_name,
                                          choices=[choice for choice, _ in results], usage=usage)
        return JSONResponse(response.model_dump(exclude_none=True))

    async def complete_one(self, request: OmniChatCompletionRequest, request_id: str, index: int):
        modalities = self.resolve_modalities(request)
        prompt, num_prompt_tokens = await self.build_prompt(request)
        params = self.build_chat_sampling_params(request)
        finals = await self.generate_final(prompt, request_id, params, None)
        return self.build_choice(request, modalities, finals, index=index, num_prompt_tokens=num_prompt_tokens,
                                 completion_index=0)
