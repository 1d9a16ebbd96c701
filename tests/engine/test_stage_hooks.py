"""Contracts of the per-pipeline stage hooks: a stage-input processor with context sees the fed stage's config and
the request, and sets that stage's sampling params; an AR stage's output collector runs once per finished
request and its `stage_data` reaches the downstream processor through the connector; Qwen3-Omni resolves to its
three stages with those hooks."""

from __future__ import annotations

import types

import pytest

from tests.engine.fakes import FakeStageClient
from tests.engine.test_orchestrator import Harness
from vllm_omni.catalog.edges import StageInput
from vllm_omni.catalog.registry import register_output_collector, register_stage_input_processor
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_config import VllmOmniARStageConfig
from vllm_omni.engine.output_collectors import get_output_collector

seen_contexts: list = []


@register_stage_input_processor("test_hooks_with_context")
def _with_context(upstream, original_prompt, context):
    seen_contexts.append((context.request_id, context.stage.stage_id, context.stage.model, context.sampling_params))
    return StageInput(f"{upstream[0].metadata['stage_data']['answer']}", {"decided_by": "processor"})


@register_output_collector("test_hooks_collector")
async def _collector(client, request_id, output):
    return {"answer": f"{request_id}:{output.text}", "rpc": await client.collective_rpc_async("fetch")}


class ParamsRecordingClient(FakeStageClient):
    """Records the sampling params each request got; stage 0 attaches stage_data like an output collector."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.params: list = []

    async def generate(self, request_id, prompt, sampling_params):
        self.params.append(sampling_params)
        async for out in super().generate(request_id, prompt, sampling_params):
            if out.finished and self.stage_id == 0:
                out.multimodal_output["stage_data"] = {"answer": "from-stage-0"}
            yield out


@pytest.mark.parametrize("connector", ["inproc", "shm"])
async def test_context_processor_sets_downstream_params_and_reads_stage_data(connector):
    seen_contexts.clear()
    config = VllmOmniConfig(
        model="m", model_path="m", pipeline_name="hooks",
        stages=[VllmOmniARStageConfig(stage_id=0, model="m"),
                VllmOmniARStageConfig(stage_id=1, model="/ckpt", inputs=[0], input_processor="test_hooks_with_context",
                                      final_output=True)],
        connectors={"0->1": {"name": connector, "shm_threshold_bytes": 0}})
    h = Harness([ParamsRecordingClient(0, final_output=False), ParamsRecordingClient(1)], config)
    h.add("r1", "hi", ["p0", "p1"])
    out = await h.next_output()
    assert out.finished and out.text == "from-stage-0|s1"
    assert seen_contexts == [("r1", 1, "/ckpt", "p1")]
    assert h.clients[0].params == ["p0"] and h.clients[1].params == [{"decided_by": "processor"}]
    await h.close()


async def test_ar_client_runs_the_output_collector_once_per_finished_request():
    from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClient

    rpc_calls = []

    class FakeCore:
        async def collective_rpc_async(self, method, timeout, args, kwargs):
            rpc_calls.append(method)
            return ["worker-result"]

    class FakeLLM:
        errored = False
        engine_core = FakeCore()

        async def generate(self, prompt, params, request_id):
            for i, finished in enumerate([False, True]):
                completion = types.SimpleNamespace(text=f"t{i}", token_ids=[i],
                                                   finish_reason="stop" if finished else None)
                yield types.SimpleNamespace(outputs=[completion], finished=finished, kv_transfer_params=None)

    from vllm import SamplingParams

    client = StageEngineCoreClient(VllmOmniARStageConfig(stage_id=0, model="m", output_collector="test_hooks_collector",
                                                         final_output=True))
    client.llm = FakeLLM()
    outs = [o async for o in client.generate("r1", "hi", SamplingParams())]
    assert "stage_data" not in outs[0].multimodal_output
    assert outs[1].multimodal_output["stage_data"] == {"answer": "r1:t1", "rpc": ["worker-result"]}
    assert rpc_calls == ["fetch"] and {"llm", "stage-0-llm"} <= set(outs[1].stage_durations)


def test_unknown_collector_is_named():
    with pytest.raises(ValueError, match="no_such_collector"):
        get_output_collector("no_such_collector")


def test_qwen3_omni_resolves_to_three_stages_with_hooks():
    from vllm_omni.config.omni_config import StageConfigFactory

    config = StageConfigFactory.create_from_model("tiny/qwen3-omni", max_model_len=256, dtype="float32")
    assert config.pipeline_name == "qwen3_omni" and config.stage_types == ["llm", "llm", "generation"]
    thinker, talker, code2wav = config.stages
    assert thinker.final_output and thinker.final_output_type == "text"
    assert talker.input_processor == "qwen3_omni_thinker_to_talker"
    assert talker.output_collector == "qwen3_omni_talker_frames"
    assert talker.engine_args["worker_extension_cls"].endswith("TalkerFramesExtension")
    assert "worker_cls" not in talker.engine_args and talker.engine_args["max_model_len"] == 256
    assert code2wav.final_output_type == "audio" and code2wav.engine_args["dtype"] == "float32"
    assert code2wav.input_processor == "qwen3_omni_talker_to_code2wav" and code2wav.model == talker.model
