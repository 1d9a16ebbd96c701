"""AsyncOmni pause/resume/sleep/wake routing by stage type (spec §2.3), against a recording engine.

AR stages go through EngineCore helpers (`pause_scheduler`, `resume_scheduler`, `sleep`, `wake_up`);
diffusion stages get worker sleep/wake only. AR sleep keeps admission closed until `resume_generation`;
a diffusion-only engine reopens admission on wake.
"""

from __future__ import annotations

import asyncio

import pytest

from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.messages import AckMetadata, StageRpcError
from vllm_omni.entrypoints.async_omni import AsyncOmni
from vllm_omni.errors import OmniClientError


class RecordingEngine:
    def __init__(self, stage_types: list[str], fail: str | None = None) -> None:
        self.stage_metadata = [{"stage_kind": StageKind(t), "final_output": True, "output_modality": "text",
                                "default_sampling_params": None} for t in stage_types]
        self.calls: list[tuple[str, tuple, dict | None, list[int]]] = []
        self.fail = fail
        self.is_dead = False

    async def collective_rpc_async(self, method, args=(), kwargs=None, stage_ids=None, timeout=None):
        self.calls.append((method, tuple(args), kwargs, list(stage_ids)))
        if method == self.fail:
            return {sid: [StageRpcError(stage_id=sid, replica_id=0, method=method, reason="failed", error="boom")]
                    for sid in stage_ids}
        return {sid: [True] for sid in stage_ids}


def make(stage_types: list[str], fail: str | None = None) -> AsyncOmni:
    omni = AsyncOmni.__new__(AsyncOmni)
    omni.engine = RecordingEngine(stage_types, fail)
    omni.model_name = "m"
    omni.request_states = {}
    omni._output_handler = None
    omni._pause_cond = None
    omni._paused = False
    omni._hold_admission_until_resume = False
    omni._sleeping_tags = set()
    omni._level2_sleeping = False
    return omni


def methods(omni) -> list[tuple[str, list[int]]]:
    return [(c[0], c[3]) for c in omni.engine.calls]


def test_split_and_validate_stage_ids():
    omni = make(["llm", "diffusion", "llm"])
    assert omni._split_stage_ids_by_type() == ([0, 2], [1])
    with pytest.raises(ValueError, match=r"Invalid stage_ids \[3\]; valid range is 0..2"):
        omni._split_stage_ids_by_type([3])
    with pytest.raises(ValueError, match=r"Invalid stage_ids \[-1\]"):
        omni._split_stage_ids_by_type([-1])
    with pytest.raises(ValueError, match="this engine has no stages"):
        make([])._split_stage_ids_by_type()


async def test_pause_routes_to_ar_and_resets_caches_every_time():
    omni = make(["llm", "diffusion"])
    for _ in range(2):  # already paused: still issues the RPCs
        omni.engine.calls.clear()
        await omni.pause_generation(mode="abort", clear_cache=True)
        assert omni._paused and omni._hold_admission_until_resume
        assert omni.engine.calls[0] == ("pause_scheduler", (), {"mode": "abort", "clear_cache": True}, [0])
        assert methods(omni)[1:] == [("reset_prefix_cache", [0]), ("reset_mm_cache", [0]),
                                     ("reset_encoder_cache", [0])]
    assert omni.engine.calls[1][1] == (True, True)  # reset_running_requests, reset_connector


async def test_wait_for_inflight_forces_wait_mode():
    omni = make(["llm"])
    await omni.pause_generation(wait_for_inflight_requests=True)
    assert omni.engine.calls[0][2] == {"mode": "wait", "clear_cache": True}
    assert omni.engine.calls[1][1] == (False, True)


async def test_resume_clears_admission_and_wakes_waiters():
    omni = make(["llm", "diffusion"])
    await omni.pause_generation(clear_cache=False)
    cond = omni._cond()

    async def waiter():
        async with cond:
            await cond.wait_for(lambda: not omni._paused)

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.05)
    assert not task.done()
    await omni.resume_generation()
    await asyncio.wait_for(task, 1)
    assert omni.engine.calls[-1] == ("resume_scheduler", (), None, [0])
    assert not omni.is_paused() and not omni._hold_admission_until_resume


async def test_mixed_sleep_then_wake_keeps_admission_closed_until_resume():
    omni = make(["llm", "diffusion"])
    acks = await omni.sleep(stage_ids=[0, 1], level=1, mode="abort")
    assert {a.stage_id for a in acks} == {0, 1}
    assert next(a for a in acks if a.stage_id == 0).metadata.path == "engine_core"
    assert acks[0].task_id.startswith("engine_core-sleep-")
    assert ("sleep", (1, "abort"), None, [0]) in omni.engine.calls
    assert ("sleep", (1,), None, [1]) in omni.engine.calls  # worker-level sleep for the diffusion stage
    assert "pause_scheduler" not in [c[0] for c in omni.engine.calls]
    assert omni._sleeping_tags >= {"weights", "kv_cache"} and omni._paused and omni._hold_admission_until_resume
    omni.engine.calls.clear()
    acks = await omni.wake_up(stage_ids=[0, 1])
    assert {a.stage_id for a in acks} == {0, 1}
    ar_wake = [c for c in omni.engine.calls if c[3] == [0]]
    assert len(ar_wake) == 1 and ar_wake[0][0] == "wake_up" and set(ar_wake[0][2]["tags"]) == {"weights",
                                                                                                "kv_cache"}
    assert not omni._sleeping_tags and omni._paused and omni._hold_admission_until_resume
    await omni.resume_generation()
    assert not omni._paused and not omni._hold_admission_until_resume


async def test_level2_flag_and_warm_wake_is_skipped(caplog):
    omni = make(["llm"])
    await omni.sleep(level=2)
    assert omni._level2_sleeping
    await omni.wake_up()
    assert not omni._level2_sleeping and not omni._sleeping_tags
    omni.engine.calls.clear()
    assert await omni.wake_up(tags=["weights"]) == []
    assert omni.engine.calls == []


async def test_partial_wake_keeps_remaining_tags():
    omni = make(["llm"])
    await omni.sleep(level=1)
    await omni.wake_up(tags=["weights"])
    assert omni._sleeping_tags == {"kv_cache"}
    await omni.wake_up()
    assert not omni._sleeping_tags


async def test_diffusion_only_sleep_and_wake_reopens_admission():
    omni = make(["diffusion"])
    acks = await omni.sleep(level=1)
    assert [a.stage_id for a in acks] == [0] and len(acks) == 1
    assert omni.engine.calls == [("sleep", (1,), None, [0])]
    assert omni._paused and not omni._hold_admission_until_resume
    cond = omni._cond()

    async def waiter():
        async with cond:
            await cond.wait_for(lambda: not omni._paused)

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.05)
    await omni.wake_up()
    await asyncio.wait_for(task, 1)
    assert not omni._paused


async def test_explicit_pause_survives_diffusion_sleep_wake():
    omni = make(["diffusion"])
    await omni.pause_generation()
    await omni.sleep(level=1)
    await omni.wake_up()
    assert omni._paused
    await omni.resume_generation()
    assert not omni._paused


async def test_rpc_error_is_raised_with_method_name():
    omni = make(["llm"], fail="sleep")
    with pytest.raises(RuntimeError, match="sleep failed: boom"):
        await omni.sleep(level=1)
    assert omni._paused  # admission was closed before the RPC was awaited


@pytest.mark.parametrize("call", ["sleep", "wake_up", "resume_generation", "pause_generation"])
@pytest.mark.parametrize("stage_ids", [[9], [-1], [0, 2], [True]])
async def test_bad_stage_ids_are_a_client_error_naming_stage_ids(call, stage_ids):
    """Out of range (or not an int) is the caller's mistake: 400 naming `stage_ids`, and nothing is called;
    wake_up checks even when every tag is already warm."""
    omni = make(["llm", "diffusion"])
    with pytest.raises(OmniClientError, match=r"Invalid stage_ids") as info:
        await getattr(omni, call)(stage_ids=stage_ids)
    assert info.value.param == "stage_ids" and info.value.status_code == 400
    assert omni.engine.calls == [] and not omni._paused


async def test_generation_stage_is_skipped_by_control_calls():
    """A GENERATION stage (Qwen3-Omni's Code2Wav) has no scheduler and no EngineCore memory: sleeping the
    whole pipeline reaches its AR stages only, instead of failing on the vocoder."""
    omni = make(["llm", "llm", "generation"])
    acks = await omni.sleep(level=1)
    assert [a.stage_id for a in acks] == [0, 1] and methods(omni) == [("sleep", [0, 1])]
    await omni.wake_up()
    await omni.pause_generation(clear_cache=False)
    assert methods(omni)[1:] == [("wake_up", [0, 1]), ("pause_scheduler", [0, 1])]


async def test_acks_are_typed_and_keep_their_json_shape():
    import msgspec

    omni = make(["llm", "diffusion"])
    acks = await omni.sleep(level=1)
    assert [a.metadata for a in acks] == [AckMetadata(path="engine_core", level=1, mode="abort"),
                                          AckMetadata(path="worker", level=1)]
    body = msgspec.to_builtins(acks)  # what /v1/omni/sleep answers
    assert [b["metadata"] for b in body] == [{"path": "engine_core", "level": 1, "mode": "abort"},
                                             {"path": "worker", "level": 1}]
    assert {b["status"] for b in body} == {"SUCCESS"}
