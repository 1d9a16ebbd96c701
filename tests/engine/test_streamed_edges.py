"""Streamed stage edges (`stream_inputs`): the downstream GENERATION stage runs a segment per upstream chunk while
the AR upstream still runs; ordering; same result as store-and-forward; a failure or an abort stops every stage.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_omni.catalog.edges import reads
from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.pipeline_config import EdgeStreamConfig, PipelineConfig, PipelineStageConfig
from vllm_omni.config.stage_config import VllmOmniARStageConfig, VllmOmniGenerationStageConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.orchestrator import Orchestrator
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.outputs import OmniRequestOutput

TOKENS = 10


def tokens_to_items(upstream, original_prompt, context):
    """Test processor: the tokens not handed on yet, in `chunk_tokens` pieces (all the rest at the end)."""
    tokens = upstream[0].metadata["token_ids"]
    start = context.state.get("next", 0)
    size = context.edge.chunk_tokens
    end = len(tokens) if context.final else start + (len(tokens) - start) // size * size
    context.state["next"] = end
    return tokens[start:end] or None


def new_tokens(upstream, original_prompt, context):
    """Test processor: every token not handed on yet."""
    tokens = upstream[0].metadata["token_ids"]
    start, context.state["next"] = context.state.get("next", 0), len(tokens)
    return tokens[start:] or None


@reads(partial_stage_data="first_chunk")
def new_tokens_first_stage_data(upstream, original_prompt, context):
    """Test processor: as `new_tokens`, reading the upstream's stage data from its first chunk only."""
    context.state.setdefault("stage_data", upstream[0].metadata["stage_data"])
    return new_tokens(upstream, original_prompt, context)


async def count_collects(client, request_id, output):
    """Test output collector: records the upstream length at each collect."""
    client.collects.append(len(output.token_ids))
    return {"tokens": len(output.token_ids)}


class TokenStage:
    """An AR stand-in emitting one more token per output (cumulative), `delay` s apart."""

    kind = StageKind.AR

    def __init__(self, delay: float = 0.01) -> None:
        self.stage_id, self.delay, self.config = 0, delay, SimpleNamespace(output_collector=None)
        self.cancelled, self.abort_calls, self.is_dead = False, [], False

    async def generate(self, request_id, prompt, params):
        try:
            for n in range(1, TOKENS + 1):
                await asyncio.sleep(self.delay)
                yield OmniRequestOutput(request_id=request_id, finished=n == TOKENS, stage_id=0, text="t" * n,
                                        token_ids=list(range(n)), final_output_type="text")
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled = True
            raise

    async def abort(self, request_ids):
        self.abort_calls.append(list(request_ids))


class AudioStage:
    """A GENERATION stand-in: one sample per item (item * 0.1); records each segment and when it ran."""

    kind = StageKind.GENERATION

    def __init__(self, fail: bool = False, delay: float = 0.0) -> None:
        self.stage_id, self.fail, self.delay, self.config = 1, fail, delay, SimpleNamespace(output_collector=None)
        self.segments, self.abort_calls, self.is_dead = [], [], False

    async def generate(self, request_id, prompt, params):
        self.segments.append(list(prompt))
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("vocoder failed")
        yield OmniRequestOutput(request_id=request_id, finished=True, stage_id=1, final_output_type="audio",
                                stage_durations={"stage-1-generation": 1.0},
                                multimodal_output={"audio": np.array(prompt, dtype=np.float32) * 0.1})

    async def abort(self, request_ids):
        self.abort_calls.append(list(request_ids))


def config(stream: bool, chunk_tokens: int = 3, first_chunk_tokens: int | None = None,
           processor: str = "tokens_to_items") -> VllmOmniConfig:
    return VllmOmniConfig(model="m", model_path="m", pipeline_name="streamed", stages=[
        VllmOmniARStageConfig(stage_id=0, model="m", final_output=True, final_output_type="text"),
        VllmOmniGenerationStageConfig(
            stage_id=1, model="m", inputs=[0], final_output=True, final_output_type="audio",
            input_processor=f"tests.engine.test_streamed_edges:{processor}",
            stream_inputs={0: EdgeStreamConfig(stream=stream, chunk_tokens=chunk_tokens,
                                               first_chunk_tokens=first_chunk_tokens)})])


async def run(stream: bool, upstream: TokenStage | None = None, downstream: AudioStage | None = None,
              abort_after: float | None = None, **edge) -> tuple[list, TokenStage, AudioStage]:
    upstream, downstream = upstream or TokenStage(), downstream or AudioStage()
    pools = [StagePool(0, [upstream], StageKind.AR), StagePool(1, [downstream], StageKind.GENERATION)]
    orch = Orchestrator(pools, config(stream, **edge), ["text", "audio"])
    seen = []
    orch.add_request("r", "p", [None, None], seen.append)
    if abort_after is not None:
        await asyncio.sleep(abort_after)
        orch.abort_soon(["r"])
    for _ in range(500):
        if (seen and (isinstance(seen[-1], Exception) or (seen[-1].finished and seen[-1].stage_id == 1))
                or (abort_after is not None and not orch.request_states)):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)  # the aborted stages' tasks end
    assert not orch.request_states and all(len(c) == 0 for c in orch.graph.connectors.values())
    orch.close()
    return seen, upstream, downstream


async def test_chunks_run_while_the_upstream_runs_and_equal_store_and_forward():
    streamed, _, audio = await run(stream=True)
    assert audio.segments == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    stages = [o.stage_id for o in streamed]
    assert stages.index(1) < len(stages) - 1 - stages[::-1].index(0)  # audio before the upstream's last token
    audio_outs = [o for o in streamed if o.stage_id == 1]
    assert [o.finished for o in audio_outs] == [False, False, False, True]
    chunks = np.concatenate([o.multimodal_output["audio_chunk"] for o in audio_outs])
    np.testing.assert_array_equal(chunks, audio_outs[-1].multimodal_output["audio"])
    assert all("audio" not in o.multimodal_output for o in audio_outs[:-1])
    assert audio_outs[-1].stage_durations["stage-1-generation"] == 4.0  # the segments' times added up

    stored, _, audio = await run(stream=False)
    assert audio.segments == [list(range(TOKENS))]
    final = stored[-1]
    assert final.finished and final.stage_id == 1
    np.testing.assert_array_equal(final.multimodal_output["audio"], audio_outs[-1].multimodal_output["audio"])
    np.testing.assert_array_equal(final.multimodal_output["audio_chunk"], final.multimodal_output["audio"])


async def test_the_first_hand_off_comes_after_first_chunk_tokens():
    """A small first chunk (the downstream starts early), larger ones after it."""
    _, _, audio = await run(stream=True, chunk_tokens=4, first_chunk_tokens=2, processor="new_tokens")
    assert audio.segments == [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]


@pytest.mark.parametrize(("processor", "collects"), [("new_tokens", [2, 6]),
                                                     ("new_tokens_first_stage_data", [2])])
async def test_partial_stage_data_is_collected_per_hand_off_unless_read_once(processor, collects):
    upstream = TokenStage()
    upstream.config.output_collector, upstream.collects = "tests.engine.test_streamed_edges:count_collects", []
    _, _, audio = await run(stream=True, upstream=upstream, chunk_tokens=4, first_chunk_tokens=2, processor=processor)
    assert audio.segments == [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9]] and upstream.collects == collects


async def test_a_failing_downstream_segment_cancels_the_upstream():
    seen, upstream, _ = await run(stream=True, upstream=TokenStage(delay=0.05), downstream=AudioStage(fail=True))
    assert isinstance(seen[-1], Exception) and "vocoder failed" in str(seen[-1])
    assert upstream.cancelled and not any(o.finished for o in seen if not isinstance(o, Exception))


async def test_abort_reaches_every_stage_holding_the_request():
    seen, upstream, audio = await run(stream=True, upstream=TokenStage(delay=0.05),
                                      downstream=AudioStage(delay=10), abort_after=0.3)
    assert upstream.abort_calls == [["r"]] and audio.abort_calls == [["r"]]
    assert not any(getattr(o, "finished", False) for o in seen)


@pytest.mark.parametrize(("edit", "message"), [
    ({"stream_inputs": {1: EdgeStreamConfig()}}, "not one of its inputs"),
    ({"execution_type": StageKind.DIFFUSION}, "not supported"),
])
def test_pipeline_refuses_streams_it_cannot_run(edit, message):
    stage = {"stage_id": 1, "execution_type": StageKind.GENERATION, "inputs": [0], "input_processor": "x",
             "final_output": True, "stream_inputs": {0: EdgeStreamConfig()}, **edit}
    with pytest.raises(ValueError, match=message):
        PipelineConfig(name="p", stages=[PipelineStageConfig(stage_id=0, execution_type=StageKind.AR),
                                         PipelineStageConfig(**stage)])


def test_only_ar_stages_stream_their_output():
    with pytest.raises(ValueError, match="only AR stages stream"):
        PipelineConfig(name="p", stages=[
            PipelineStageConfig(stage_id=0, execution_type=StageKind.GENERATION),
            PipelineStageConfig(stage_id=1, execution_type=StageKind.GENERATION, inputs=[0], input_processor="x",
                                final_output=True, stream_inputs={0: EdgeStreamConfig(chunk_tokens=4)})])
