"""A stand-in for `AsyncOmni` (contract 4) that isolates the HTTP layer's own contract in unit tests.

It follows the contract's shapes exactly (stage types, per-stage params, OmniRequestOutput streams, abort);
the live tests in this folder run the real engine behind the same server.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.capabilities import ModelCapabilities
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.outputs import OmniRequestOutput


@dataclass
class _Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class _RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[_Completion]


class _Tokenizer:
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def apply_chat_template(self, messages, tokenize=False, chat_template=None, add_generation_prompt=True,
                            continue_final_message=False, **kwargs) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


@dataclass
class FakeOmni:
    stage_types: list[str]
    output_modalities: set[str]
    input_modalities: set[str] = field(default_factory=lambda: {"text"})
    model_name: str = "fake"
    step_delay_s: float = 0.0
    is_dead: bool = False
    is_sleeping: bool = False
    seen: list[tuple[Any, str, list[Any]]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    calls: list[tuple[str, dict]] = field(default_factory=list)
    shape_rules: tuple[Any, ...] = ()

    @property
    def capabilities(self) -> ModelCapabilities:
        return ModelCapabilities(stage_kinds=tuple(StageKind(t) for t in self.stage_types),
                                 input_modalities=frozenset(self.input_modalities),
                                 output_modalities=frozenset(self.output_modalities),
                                 shape_rules=self.shape_rules)

    @property
    def default_sampling_params_list(self) -> list[Any]:
        from vllm import SamplingParams

        return [OmniDiffusionSamplingParams(num_inference_steps=4) if t == "diffusion" else SamplingParams()
                for t in self.stage_types]

    def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer()

    async def check_health(self) -> None:
        if self.is_dead:
            raise RuntimeError("dead")

    async def generate(self, prompt: Any, request_id: str, sampling_params_list: list[Any] | None = None,
                       output_modalities: list[str] | None = None):
        self.seen.append((prompt, request_id, sampling_params_list))
        self.running.add(request_id)
        try:
            for stage_id, stage_type in enumerate(self.stage_types):
                last = stage_id == len(self.stage_types) - 1
                async for out in self._stage(stage_type, stage_id, prompt, request_id,
                                             sampling_params_list[stage_id], last):
                    yield out
        finally:
            self.running.discard(request_id)

    async def _stage(self, stage_type, stage_id, prompt, request_id, params, last):
        if stage_type == "llm":
            words = [f"w{i}" for i in range(params.max_tokens)]
            for n in range(1, len(words) + 1):
                await asyncio.sleep(self.step_delay_s)
                done = n == len(words)
                ro = _RequestOutput([1, 2, 3], [_Completion(" ".join(words[:n]), list(range(n)),
                                                            "length" if done else None)])
                yield OmniRequestOutput(request_id=request_id, finished=done and last, stage_id=stage_id,
                                        final_output_type="text", text=ro.outputs[0].text, request_output=ro,
                                        stage_durations={"thinker": 0.01} if done else {})
        elif stage_type == "diffusion":
            await asyncio.sleep(self.step_delay_s)
            if params.width == 13:
                yield OmniRequestOutput(request_id=request_id, error="width must be a multiple of 16",
                                        error_status_code=400)
                return
            size = (params.width or 32, params.height or 32)
            images = [Image.new("RGB", size, (i * 40, 0, 0)) for i in range(params.num_outputs_per_prompt)]
            yield OmniRequestOutput(request_id=request_id, finished=last, stage_id=stage_id,
                                    final_output_type="image", images=images,
                                    stage_durations={"diffusion.denoise": 0.02})
        else:
            await asyncio.sleep(self.step_delay_s)
            audio = np.sin(np.linspace(0, 100, 2400, dtype=np.float32)) * 0.5
            yield OmniRequestOutput(request_id=request_id, finished=last, stage_id=stage_id,
                                    final_output_type="audio",
                                    multimodal_output={"audio": audio, "sample_rate": 24000})

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def sleep(self, stage_ids=None, level=2):
        self.calls.append(("sleep", {"stage_ids": stage_ids, "level": level}))
        self.is_sleeping = True
        return [{"stage_id": 0, "status": "SUCCESS"}]

    async def wake_up(self, stage_ids=None, tags=None):
        self.calls.append(("wake_up", {"stage_ids": stage_ids, "tags": tags}))
        self.is_sleeping = False
        return [{"stage_id": 0, "status": "SUCCESS"}]

    async def resume_generation(self, stage_ids=None):
        self.calls.append(("resume_generation", {"stage_ids": stage_ids}))

    def close(self) -> None:
        pass
