"""`ModelCapabilities`: computed once by the engine from what each stage declares (its family spec) and the
stage graph: the request's inputs are what the stages fed by the user's prompt take, its outputs what the
final stages make."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import VllmOmniARStageConfig, VllmOmniDiffusionStageConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.async_omni_engine import AsyncOmniEngine
from vllm_omni.engine.capabilities import ModelCapabilities
from vllm_omni.engine.stage_client import StageClientBase
from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClient


class Stub(StageClientBase):
    async def start(self) -> None:
        pass

    def default_sampling_params(self):
        return None

    @property
    def is_dead(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass


class TextLM(Stub):
    kind = StageKind.AR
    output_modality = "text"


class ImageEditor(Stub):
    kind = StageKind.DIFFUSION
    output_modality = "image"
    input_modalities = frozenset({"text", "image"})


def start(stages) -> ModelCapabilities:
    config = VllmOmniConfig(model="m", model_path="m", pipeline_name="p", stages=stages)
    engine = AsyncOmniEngine(config, stage_client_factory=lambda s, _: (TextLM if s.kind is StageKind.AR
                                                                        else ImageEditor)(s))
    try:
        return engine.capabilities
    finally:
        engine.shutdown()


def test_inputs_come_from_entry_stages_outputs_from_final_stages():
    caps = start([VllmOmniARStageConfig(stage_id=0, model="m", final_output=True),
                  VllmOmniDiffusionStageConfig(stage_id=1, model="m", inputs=[0], input_processor="text_to_prompt",
                                               final_output=True)])
    assert caps == ModelCapabilities(stage_kinds=(StageKind.AR, StageKind.DIFFUSION),
                                     input_modalities=frozenset({"text"}),
                                     output_modalities=frozenset({"text", "image"}))
    # The editor sits behind the LM: the request itself cannot carry an image.
    assert caps.starts_with_ar and not caps.accepts_image_input and not caps.supports_edits


def test_image_editor_alone_supports_edits():
    caps = start([VllmOmniDiffusionStageConfig(stage_id=0, model="m", final_output=True)])
    assert caps.accepts_image_input and caps.supports_edits and not caps.starts_with_ar
    assert caps.describe() == "takes ['image', 'text'], makes ['image']"


def test_capability_questions():
    t2i = ModelCapabilities((StageKind.DIFFUSION,), frozenset({"text"}), frozenset({"image"}))
    i2v = ModelCapabilities((StageKind.DIFFUSION,), frozenset({"text", "image"}), frozenset({"video"}))
    assert not t2i.supports_edits and not t2i.accepts_image_input
    assert i2v.accepts_image_input and not i2v.supports_edits  # image in, but no image out
    with pytest.raises(ValueError, match="at least one stage"):
        ModelCapabilities((), frozenset(), frozenset())


def test_ar_stage_inputs_come_from_its_family_spec(monkeypatch):
    from vllm_omni.catalog import registry
    from vllm_omni.catalog.spec import ModelSpec

    fresh = registry.OmniModelRegistry({})
    fresh.register_family(ModelSpec(family="test-vlm", description="", architectures=("SeeingLM",),
                                    input_modalities=frozenset({"text", "image"})))
    monkeypatch.setattr(registry, "MODEL_REGISTRY", fresh)
    client = StageEngineCoreClient(VllmOmniARStageConfig(stage_id=0, model="m"))
    model_config = SimpleNamespace(architectures=["SeeingLM"])
    client.llm = SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config))
    assert client.input_modalities == {"text", "image"}
    model_config.architectures = ["Qwen2ForCausalLM"]  # no family claims it: a text LM
    assert client.input_modalities == {"text"}
