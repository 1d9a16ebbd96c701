"""Edge stream fields are honoured or refused when the pipeline is resolved, never accepted and ignored."""

from __future__ import annotations

import json

import pytest

from vllm_omni.config import StageConfigFactory
from vllm_omni.config.pipeline_config import EdgeStreamConfig
from vllm_omni.errors import OmniClientError
from vllm_omni.models.qwen3_omni.pipeline import qwen3_omni_pipeline

THREE_STAGES_YAML = """
name: omni-like
stages:
  - stage_id: 0
    execution_type: ar
    final_output: true
  - stage_id: 1
    execution_type: ar
    inputs: [0]
    input_processor: qwen3_omni_thinker_to_talker
    stream_inputs:
      0: {talker_edge}
  - stage_id: 2
    execution_type: generation
    inputs: [1]
    input_processor: qwen3_omni_talker_to_code2wav
    final_output: true
    engine_args:
      model_class: "vllm_omni.models.qwen3_omni.code2wav:Qwen3OmniCode2Wav"
    stream_inputs:
      1: {vocoder_edge}
"""


@pytest.fixture
def omni_dir(tmp_path):
    d = tmp_path / "omni"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3OmniMoeForConditionalGeneration"],
                                               "model_type": "qwen3_omni_moe"}))
    return d


def resolve(tmp_path, model_dir, talker_edge: str, vocoder_edge: str):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(THREE_STAGES_YAML.replace("{talker_edge}", talker_edge).replace("{vocoder_edge}", vocoder_edge))
    return StageConfigFactory.create_from_model(str(model_dir), pipeline_config=str(pipeline))


def test_chunk_schedule_on_the_thinker_to_talker_edge_is_refused(tmp_path, omni_dir):
    with pytest.raises(OmniClientError, match=r"stages\[1\]\.stream_inputs\[0\]\.chunk_schedule \(edge 0->1\)"
                       r".*'qwen3_omni_thinker_to_talker' does not read it") as e:
        resolve(tmp_path, omni_dir, "{stream: true, chunk_schedule: [4, 8]}", "{chunk_schedule: [4, 8]}")
    assert e.value.param == "stages[1].stream_inputs[0].chunk_schedule"


@pytest.mark.parametrize("field", ["chunk_tokens: 4", "first_chunk_tokens: 2"])
def test_hand_off_sizes_on_a_store_and_forward_edge_are_refused(tmp_path, omni_dir, field):
    name = field.split(":")[0]
    with pytest.raises(OmniClientError, match=rf"stages\[2\]\.stream_inputs\[1\]\.{name} .*stream: false"):
        resolve(tmp_path, omni_dir, "{stream: false}", f"{{stream: false, {field}}}")


def test_fields_their_edge_reads_are_kept(tmp_path, omni_dir):
    config = resolve(tmp_path, omni_dir, "{first_chunk_tokens: 4, chunk_tokens: 16}",
                     "{stream: false, chunk_schedule: [4, 8, 16]}")
    talker, vocoder = config.stages[1], config.stages[2]
    assert talker.stream_inputs[0] == EdgeStreamConfig(first_chunk_tokens=4, chunk_tokens=16)
    assert vocoder.stream_inputs[1] == EdgeStreamConfig(stream=False, chunk_schedule=[4, 8, 16])


@pytest.mark.parametrize("stream", [True, False])
def test_the_qwen3_omni_default_pipeline_resolves(omni_dir, stream):
    config = StageConfigFactory.create_from_model(str(omni_dir), pipeline_config=qwen3_omni_pipeline(stream))
    talker, vocoder = config.stages[1].stream_inputs[0], config.stages[2].stream_inputs[1]
    assert talker.stream is vocoder.stream is stream
    assert vocoder.chunk_schedule == [4, 8, 16, 32]
    assert (talker.first_hand_off(), vocoder.first_hand_off()) == ((4, 6) if stream else (1, 1))


def test_idle_chunk_growth_into_a_generation_stage_is_refused(tmp_path, omni_dir):
    with pytest.raises(OmniClientError, match=r"stages\[2\]\.stream_inputs\[1\]\.idle_chunk_growth .*only a "
                       r"stream-fed AR stage waits for input"):
        resolve(tmp_path, omni_dir, "{idle_chunk_growth: 0.5}", "{idle_chunk_growth: 0.5}")
    config = resolve(tmp_path, omni_dir, "{idle_chunk_growth: 0.5}", "{}")
    assert config.stages[1].stream_inputs[0].idle_chunk_growth == 0.5


def hand_offs_to_a_waiting_stage(edge: EdgeStreamConfig, tokens: int) -> list[int]:
    """Upstream lengths at the hand-offs to a downstream that always waits (the most it can get), the end's too."""
    at = [edge.first_hand_off()]
    while at[-1] + edge.hand_off_due(at[-1], downstream_waits=True) < tokens:
        at.append(at[-1] + edge.hand_off_due(at[-1], downstream_waits=True))
    return [*at, tokens]


def test_a_waiting_stage_gets_growing_hand_offs_up_to_chunk_tokens():
    """Their number follows the upstream's length, not the stages' speeds: Qwen3-Omni's 32-token reply reaches
    its talker in 4 hand-offs at most (test_round_trips.py), and a 200-token one keeps reaching it every 16."""
    edge = EdgeStreamConfig(first_chunk_tokens=4, chunk_tokens=16)
    assert hand_offs_to_a_waiting_stage(edge, 32) == [4, 8, 16, 32]
    assert hand_offs_to_a_waiting_stage(edge, 200) == [4, 8, 16, *range(32, 200, 16), 200]
    assert edge.hand_off_due(8, downstream_waits=False) == 16  # a busy downstream: every chunk_tokens
    at_once = EdgeStreamConfig(first_chunk_tokens=4, chunk_tokens=16, idle_chunk_growth=0)
    assert hand_offs_to_a_waiting_stage(at_once, 32) == list(range(4, 33))
    slower = EdgeStreamConfig(first_chunk_tokens=4, chunk_tokens=16, idle_chunk_growth=0.5)
    assert hand_offs_to_a_waiting_stage(slower, 32) == [4, 6, 9, 14, 21, 32]
