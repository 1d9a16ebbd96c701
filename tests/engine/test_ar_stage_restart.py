"""The AR stage's restart budget: `max_stage_restarts` reaches the stage config (not vLLM's engine args),
a dead AsyncLLM is shut down and re-created while the budget lasts, and the stage is dead after it.

`_start_llm` is replaced by a stand-in AsyncLLM so the budget logic is tested alone; the real EngineCore
kill is tests/reliability/test_ar_stage_fault.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from vllm_omni.config.omni_config import StageConfigFactory
from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClient
from vllm_omni.errors import OmniClientError, StageRestartingError


@pytest.fixture
def lm_dir(tmp_path):
    d = tmp_path / "lm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    return d


def ar_stage(lm_dir, **kwargs):
    (stage,) = StageConfigFactory.create_from_model(str(lm_dir), **kwargs).stages
    return stage


def test_max_stage_restarts_is_the_stage_s_not_vllm_s(lm_dir):
    assert ar_stage(lm_dir).max_stage_restarts == 3
    stage = ar_stage(lm_dir, max_stage_restarts=1, max_model_len=128)
    assert stage.max_stage_restarts == 1
    assert stage.make_engine_args().max_model_len == 128  # built without the stage's own argument


def test_negative_max_stage_restarts_is_refused_naming_it(lm_dir):
    with pytest.raises(OmniClientError) as err:
        ar_stage(lm_dir, max_stage_restarts=-1)
    assert err.value.param == "max_stage_restarts"


class StandInLLM:
    errored = False
    shut_down = False

    def __init__(self) -> None:
        self.failed_with: list[Exception] = []  # what the stage told the requests it held
        self.output_processor = SimpleNamespace(propagate_error=self.failed_with.append)

    def shutdown(self, timeout=None):
        self.shut_down = True


class StandInClient(StageEngineCoreClient):
    started: list[StandInLLM]

    async def _start_llm(self) -> None:
        await asyncio.sleep(0.3)  # long enough to be seen restarting
        self.llm = StandInLLM()
        self.started.append(self.llm)


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


def test_dead_engine_is_recreated_within_the_budget_then_the_stage_is_dead(lm_dir):
    from vllm import SamplingParams

    async def scenario():
        client = StandInClient(ar_stage(lm_dir, max_stage_restarts=1))
        client.started = []
        await client.start()
        first = client.llm
        first.errored = True
        await wait_for(lambda: client.is_restarting)
        assert not client.is_dead
        with pytest.raises(StageRestartingError):
            await anext(client.generate("r", "hi", SamplingParams()))
        await wait_for(lambda: not client.is_restarting)
        assert first.shut_down and len(client.started) == 2 and client.llm is not first and not client.is_dead
        assert [type(e).__name__ for e in first.failed_with] == ["EngineDeadError"]  # vLLM's, which `generate` maps
        second = client.llm
        second.errored = True  # the budget (1) is spent
        await wait_for(lambda: client.is_dead)
        # shut down, and the reference dropped (no AsyncLLM.__del__ at interpreter exit)
        assert second.shut_down and client.llm is None and len(client.started) == 2 and not client.is_restarting
        client.shutdown()

    asyncio.run(scenario())


class SlowBuildClient(StageEngineCoreClient):
    """The real `_start_llm` with a stand-in AsyncLLM constructor; builds after the first take 1 s (an
    EngineCore starting), so a shutdown lands in the middle of a restart."""

    built: list[StandInLLM]

    @classmethod
    def _build_llm(cls, async_llm_cls, vllm_config, engine_args, registry):
        if cls.built:
            time.sleep(1.0)
        llm = StandInLLM()
        llm.engine_core = SimpleNamespace(resources=SimpleNamespace())
        cls.built.append(llm)
        return llm


def test_shutdown_during_a_restart_leaves_no_half_built_engine(lm_dir):
    """Why: the restart's AsyncLLM constructor runs in a thread that cannot be interrupted; a shutdown that only
    cancelled the waiting task left the EngineCore it was starting running, owned by nobody."""

    async def scenario():
        SlowBuildClient.built = []
        client = SlowBuildClient(ar_stage(lm_dir, max_stage_restarts=2))
        await client.start()
        first = client.llm
        first.errored = True
        await wait_for(lambda: client.is_restarting and client._building is not None)
        client.shutdown()  # while the second EngineCore is still starting
        assert first.shut_down and len(SlowBuildClient.built) == 2
        assert SlowBuildClient.built[1].shut_down, "the engine built during shutdown was left running"
        assert client.llm is None and client.is_dead
        await asyncio.sleep(0.1)  # the cancelled restart task ends without adopting anything
        assert client.llm is None

    asyncio.run(scenario())
