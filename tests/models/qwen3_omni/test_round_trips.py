"""Process round trips of one chat with audio (issue 24): the talker's codec frames and the thinker's prompt capture
come back in-band with each engine step's outputs, so the API process sends its EngineCores the requests and
nothing else: no `collective_rpc` per hand-off, no poll at the finish (35 round trips before for 97 frames, 28 of
them RPCs). Counted on vLLM's `AsyncMPClient` of both AR stages (every message to an EngineCore goes through one of
the counted calls), on the package's `Omni`.

What remains is the thinker's request and the talker's streaming-input chunks and input close. The chunks no
longer follow the two stages' relative speed: a waiting talker gets the thinker's newest tokens once they are as
many as those it has (`EdgeStreamConfig.idle_chunk_growth`, at most `chunk_tokens` = 16), so the 32 thinker tokens
reach it in at most 4 hand-offs (after 4, 8 and 16 tokens, and at the end), each making at most one input chunk:
1 + 4 + 1 = 6 however loaded the machine. Before (the newest tokens handed to a waiting talker at once) this
request took 6 on a warm engine at load 35, 7 on a cold one at load 44, 10 beside the suite's other pytest worker.
"""

from __future__ import annotations

from collections import Counter

import pytest

from .conftest import chat_prompt_ids

pytestmark = pytest.mark.slow
MAX_ROUND_TRIPS = 6
"""The thinker's request, the talker's input chunks (one per hand-off at most: 4) and its input close."""
ONCE_PER_ENGINE = {"utility:get_supported_tasks"}
"""vLLM's `AsyncLLM` asks its EngineCore once and keeps the answer: not a cost of the request."""


def count_round_trips(omni, monkeypatch) -> Counter:
    calls: Counter = Counter()
    for client in omni.engine.stage_clients[:2]:
        core = client.llm.engine_core
        for name in ("add_request_async", "abort_requests_async", "call_utility_async"):
            def counted(*args, _call=getattr(core, name), _name=name, _stage=client.stage_id):
                calls[(_stage, _name if _name != "call_utility_async" else f"utility:{args[0]}")] += 1
                return _call(*args)

            monkeypatch.setattr(core, name, counted)
    return calls


def test_chat_with_audio_sends_requests_only(omni, tiny_path, monkeypatch):
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": chat_prompt_ids(tiny_path, "Hello! How are you today?")[0].tolist()}
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=100), None]
    frames: list = []
    talker = omni.engine.stage_clients[1]
    generate = talker.generate

    async def spy(request_id, prompt, params):
        async for out in generate(request_id, prompt, params):
            if out.finished:
                frames.extend(out.multimodal_output["stage_data"]["codec_frames"])
            yield out

    monkeypatch.setattr(talker, "generate", spy)
    calls = count_round_trips(omni, monkeypatch)
    outputs = omni.generate([prompt], params, use_tqdm=False)

    assert outputs[-1].final_output_type == "audio" and outputs[-1].finished
    assert len(frames) >= 90, len(frames)  # ~100 talker frames (the tiny talker may stop at its EOS)
    print(f"{len(frames)} talker frames, {sum(calls.values())} round trips: {dict(calls)}")
    per_request = {key: n for key, n in calls.items() if key[1] not in ONCE_PER_ENGINE}
    assert {name for _, name in per_request} <= {"add_request_async"}, calls  # no collective_rpc, no poll
    assert sum(per_request.values()) <= MAX_ROUND_TRIPS, calls
