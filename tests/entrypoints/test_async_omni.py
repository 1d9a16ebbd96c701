"""AsyncOmni on a real single-AR-stage pipeline (tiny Qwen2 on vLLM EngineCore, CPU).

Pins: greedy tokens equal the reference (transformers, which the tiny-LM test ties to plain vLLM), streaming
with per-stage durations, client errors naming the field, acknowledged abort under load (<= 1 s, request
freed in the stage), pause/resume admission, and stage death -> its requests fail within 10 s (503 while the
one restart lasts, then dead), and a clean close (no child process, no shm segment). One engine for the whole
module (~40 s start-up).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from tests.entrypoints.leak_checks import shm_segments, wait_until_clean
from vllm_omni import AsyncOmni
from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.errors import EngineDeadError, OmniClientError, StageRestartingError

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]
PROMPTS = ["A photo of a cat sitting on a red chair", "hello world"]


@pytest.fixture(scope="module")
def omni():
    # One restart: the last test kills the EngineCore twice, the stage comes back once, then is dead.
    engine = AsyncOmni("tiny/qwen2", dtype="float32", max_model_len=512, max_num_seqs=8, enforce_eager=True,
                       gpu_memory_utilization=0.15, seed=0, max_stage_restarts=1)
    yield engine
    engine.close()


async def test_the_ar_stage_reports_its_start_up_phases(omni):
    """Why: each stage's start-up log line (issue 30) says where its seconds went (vLLM's EngineCore logs its own)."""
    phases = omni.engine.stage_clients[0].startup_phases
    assert list(phases) == ["vLLM config", "EngineCore"] and phases["EngineCore"] > 0


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, **kw)


def hf_greedy(prompt: str, n: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny("qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()


async def collect(omni, prompt, rid, params):
    return [out async for out in omni.generate(prompt, rid, params)]


async def test_second_event_loop_is_refused_not_hung(omni):
    """One AsyncOmni serves the loop it was first used in; another loop gets a clear error, not a hang."""

    def in_other_loop() -> None:
        asyncio.run(collect(omni, "hi", "other-loop", SamplingParams(max_tokens=2)))

    await collect(omni, "hi", "first-loop", SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="bound to the event loop"):
        await asyncio.wait_for(asyncio.to_thread(in_other_loop), timeout=30)
    assert "other-loop" not in omni.request_states


async def test_metadata(omni):
    assert omni.stage_types == ["llm"] and omni.output_modalities == {"text"}
    assert omni.model_name == "tiny/qwen2" and omni.get_tokenizer() is not None
    assert isinstance(omni.default_sampling_params_list[0], SamplingParams)
    await omni.check_health()
    assert not omni.is_dead and not omni.errored


async def test_greedy_tokens_match_reference(omni):
    results = await asyncio.gather(*(collect(omni, p, f"greedy-{i}", [greedy(16)]) for i, p in enumerate(PROMPTS)))
    for prompt, outs in zip(PROMPTS, results, strict=True):
        final = outs[-1]
        assert final.finished and final.stage_id == 0 and final.final_output_type == "text"
        assert final.token_ids == hf_greedy(prompt, 16)
        assert isinstance(final.text, str)  # detokenized by vLLM's incremental detokenizer
        assert {"llm", "e2e"} <= set(final.stage_durations)


async def test_streaming_delta_outputs(omni):
    outs = await collect(omni, PROMPTS[1], "stream", greedy(8, output_kind=RequestOutputKind.DELTA))
    assert len(outs) >= 2 and [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert sum(len(o.token_ids) for o in outs) == 8


async def test_streamed_outputs_reach_the_caller_while_the_engine_runs_the_request(omni):
    """No burst between vLLM's output handler and the caller: every output the caller reads before the last one
    comes while vLLM still holds the request (a pump or queue that held outputs back would hand them on after it
    ended), one engine step at a time as vLLM hands them on (its collector merges only what a lagging reader has
    not taken; this reader does nothing else, so on a loaded machine a few merge, never most)."""
    n = 300
    held = omni.engine.stage_clients[0].llm.output_processor.external_req_ids
    still_running, tokens = [], []
    async for out in omni.generate(PROMPTS[1], "no-burst", [greedy(n, output_kind=RequestOutputKind.CUMULATIVE)]):
        if not out.finished:
            still_running.append(bool(held.get("no-burst")))
        tokens.append(len(out.token_ids))
    assert tokens[-1] == n and still_running and all(still_running), still_running.count(False)
    assert len(tokens) >= n // 4, f"{n} tokens came in {len(tokens)} outputs"


async def test_client_errors_name_the_field(omni):
    with pytest.raises(OmniClientError) as info:
        await collect(omni, "x", "bad-list", [greedy(4), greedy(4)])
    assert info.value.param == "sampling_params_list"
    with pytest.raises(OmniClientError, match="maximum context length") as info:
        await collect(omni, "word " * 600, "too-long", [greedy(4)])
    assert info.value.status_code == 400 and info.value.param == "input_tokens"
    # the engine is still fine
    outs = await collect(omni, "ok", "after-error", [greedy(2)])
    assert outs[-1].finished and len(outs[-1].token_ids) == 2


async def test_abort_ack_under_load_frees_the_request(omni):
    stage = omni.engine.stage_clients[0]
    tasks = {f"load-{i}": asyncio.create_task(collect(omni, PROMPTS[0], f"load-{i}", [greedy(400)]))
             for i in range(6)}
    await asyncio.sleep(0.5)
    start = time.perf_counter()
    await omni.abort("load-0")
    ack_s = time.perf_counter() - start
    assert ack_s <= 1.0, f"abort ack took {ack_s:.2f} s"
    assert "load-0" not in omni.request_states
    assert "load-0" not in omni.engine.orchestrator.request_states
    await asyncio.wait_for(tasks.pop("load-0"), 5)  # the aborted stream ends
    assert all(not rid.startswith("load-0") for rid in stage.llm.output_processor.request_states)
    await omni.abort(list(tasks))
    await asyncio.wait_for(asyncio.gather(*tasks.values()), 10)
    deadline = time.monotonic() + 5
    while stage.llm.output_processor.get_num_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert stage.llm.output_processor.get_num_unfinished_requests() == 0


async def test_cancelled_generate_aborts_in_engine(omni):
    stage = omni.engine.stage_clients[0]
    task = asyncio.create_task(collect(omni, PROMPTS[0], "cancel-me", [greedy(400)]))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while stage.llm.output_processor.get_num_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert stage.llm.output_processor.get_num_unfinished_requests() == 0
    outs = await collect(omni, "again", "cancel-me", [greedy(2)])  # the id is reusable
    assert outs[-1].finished


async def test_pause_holds_admission_until_resume(omni):
    await omni.pause_generation(mode="abort")
    assert omni.is_paused()
    task = asyncio.create_task(collect(omni, PROMPTS[1], "during-pause", [greedy(4)]))
    await asyncio.sleep(0.5)
    assert not task.done()
    await omni.resume_generation()
    outs = await asyncio.wait_for(task, 10)
    assert not omni.is_paused() and len(outs[-1].token_ids) == 4


async def test_collective_rpc_and_stage_validation(omni):
    assert await omni.reset_prefix_cache() is True
    with pytest.raises(ValueError, match=r"Invalid stage_ids \[1\]; valid range is 0..0"):
        await omni.collective_rpc("reset_prefix_cache", stage_ids=[1])


def kill_engine_core(omni, marked_dead_first: bool) -> float:
    """SIGKILL the stage's EngineCore; with `marked_dead_first`, the engine is first marked dead as vLLM's monitor
    thread does before its clean-up fails the requests (from the output handler, which the stage's shutdown
    cancels): the order in which the stage's death watch comes between the two."""
    engine_core = omni.engine.stage_clients[0].llm.engine_core
    start = time.perf_counter()
    if marked_dead_first:
        engine_core.resources.engine_dead = True
    for proc in engine_core.resources.engine_manager.processes:
        os.kill(proc.pid, 9)
    return start


async def test_killed_stage_fails_its_requests_fast_comes_back_once_then_close_is_clean(omni):
    """Why the first kill marks the engine dead first: the requests of a killed EngineCore waited for their
    client's 120 s timeout when the stage's restart began between vLLM's two steps (CI, test_ar_stage_fault)."""
    shm_before = shm_segments()
    task = asyncio.create_task(collect(omni, PROMPTS[0], "doomed", [greedy(400)]))
    await asyncio.sleep(0.5)
    start = kill_engine_core(omni, marked_dead_first=True)
    with pytest.raises(StageRestartingError):
        await asyncio.wait_for(task, 10)
    assert time.perf_counter() - start <= 10
    deadline = time.monotonic() + 90
    while omni.engine.stage_clients[0].is_restarting:
        assert time.monotonic() < deadline, "the stage did not come back within 90 s"
        await asyncio.sleep(0.2)
    assert (await collect(omni, "hi", "back", [greedy(2)]))[-1].finished

    task = asyncio.create_task(collect(omni, PROMPTS[0], "doomed-2", [greedy(400)]))
    await asyncio.sleep(0.5)
    start = kill_engine_core(omni, marked_dead_first=False)  # the restart budget (1) is spent
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(task, 10)
    assert time.perf_counter() - start <= 10
    deadline = time.monotonic() + 10
    while not omni.is_dead and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert omni.is_dead
    with pytest.raises(EngineDeadError):
        await omni.check_health()
    with pytest.raises(EngineDeadError):
        await collect(omni, "x", "after-death", [greedy(2)])
    omni.close()
    children, orphans = await asyncio.to_thread(wait_until_clean, shm_before)
    assert children == [] and orphans == set()
