"""All replicas of one stage: request dispatch (least in-flight among the serving ones) and control RPC routing.

A replica that dies or restarts its workers stops getting requests while another one serves; the stage is
degraded (reported by `/health`), and dead only when none is left.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.messages import StageRpcError
from vllm_omni.engine.output_collectors import get_output_collector
from vllm_omni.engine.stage_client import StageClientBase
from vllm_omni.errors import EngineDeadError
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)


class StagePool:
    DISPATCH_WAIT_TIMEOUT_S = 10.0
    DISPATCH_RETRY_INTERVAL_S = 0.1
    _ENGINE_CORE_CONTROL_ASYNC_METHODS = frozenset({"pause_scheduler", "resume_scheduler", "sleep", "wake_up"})
    """AR control methods that go to vLLM's `AsyncMPClient.<method>_async` helpers, not to the workers."""

    def __init__(self, stage_id: int, clients: list[StageClientBase | None], kind: StageKind | None = None) -> None:
        self.stage_id = stage_id
        self.clients = clients
        self._kind = kind
        self._inflight: dict[str, int] = {}
        self._load: dict[int, int] = {}
        self.dispatched: dict[int, int] = {}
        """Requests each replica was given since start, by replica id (the stats of load balancing)."""

    @property
    def kind(self) -> StageKind:
        if self._kind is None:
            self._kind = next(c.kind for c in self.clients if c is not None)
        return self._kind

    @property
    def is_dead(self) -> bool:
        attached = [c for c in self.clients if c is not None]
        return bool(attached) and all(c.is_dead for c in attached)

    def replica_states(self) -> list[str]:
        """Per replica: "serving", "restarting", "dead" or "not_attached"."""
        return [_replica_state(c) for c in self.clients]

    @property
    def is_degraded(self) -> bool:
        """Some replica does not serve (dead or restarting)."""
        return any(state != "serving" for state in self.replica_states())

    @property
    def is_serving(self) -> bool:
        """At least one replica takes requests now."""
        return "serving" in self.replica_states()

    def on_loop(self) -> None:
        """Each replica's `on_loop` (duck-typed clients may leave it out)."""
        for client in self.clients:
            if (hook := getattr(client, "on_loop", None)) is not None:
                hook()

    def active_replica(self, request_id: str) -> int | None:
        return self._inflight.get(request_id)

    async def _pick_replica(self) -> int:
        deadline = asyncio.get_running_loop().time() + self.DISPATCH_WAIT_TIMEOUT_S
        while True:
            states = self.replica_states()
            serving = [i for i, state in enumerate(states) if state == "serving"]
            # A restarting replica answers for itself (wait or 503) when no other one serves.
            alive = serving or [i for i, state in enumerate(states) if state == "restarting"]
            if alive:
                return min(alive, key=lambda i: self._load.get(i, 0))
            if self.is_dead or asyncio.get_running_loop().time() >= deadline:
                raise EngineDeadError(f"stage {self.stage_id} has no live replica")
            await asyncio.sleep(self.DISPATCH_RETRY_INTERVAL_S)

    async def generate(self, request_id: str, prompt: Any, sampling_params: Any) -> AsyncIterator[OmniRequestOutput]:
        replica = await self._pick_replica()
        self._inflight[request_id] = replica
        self._load[replica] = self._load.get(replica, 0) + 1
        self.dispatched[replica] = self.dispatched.get(replica, 0) + 1
        try:
            async for out in self.clients[replica].generate(request_id, prompt, sampling_params):
                yield out
        finally:
            self._load[replica] -= 1
            self._inflight.pop(request_id, None)

    async def partial_stage_data(self, request_id: str, output: OmniRequestOutput) -> dict[str, Any]:
        """What a running request has produced so far besides tokens (its stage's output collector), for a
        streamed edge; {} for stages without one."""
        client = self.clients[self._inflight[request_id]]
        name = client.config.output_collector
        if name is None:
            return {}
        return await get_output_collector(name)(client, request_id, output)

    async def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            if (replica := self._inflight.get(rid)) is not None:
                by_replica.setdefault(replica, []).append(rid)
        for replica, ids in by_replica.items():
            await self.clients[replica].abort(ids)

    async def collective_rpc(self, replica_id: int, method: str, timeout: float | None = None,
                             args: tuple | list | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        client = self.clients[replica_id] if replica_id < len(self.clients) else None
        if client is None:
            return self._rpc_error(replica_id, method, "not_attached",
                                   f"stage {self.stage_id} replica {replica_id} is not attached")
        args = tuple(args or ())
        try:
            if self.kind is StageKind.AR and method in self._ENGINE_CORE_CONTROL_ASYNC_METHODS:
                helper = getattr(client, f"{method}_async")
                return await asyncio.wait_for(helper(*args, **(kwargs or {})), timeout=timeout)
            return await asyncio.wait_for(
                client.collective_rpc_async(method=method, timeout=timeout, args=args, kwargs=kwargs),
                timeout=None if timeout is None else timeout + 1.0)
        except TimeoutError:
            return self._rpc_error(replica_id, method, "timeout",
                                   f"stage {self.stage_id} replica {replica_id}: {method} timed out after {timeout} s")
        except Exception as e:
            logger.warning("stage %d replica %d: %s failed: %s", self.stage_id, replica_id, method, e)
            return self._rpc_error(replica_id, method, "failed", f"{type(e).__name__}: {e}")

    def _rpc_error(self, replica_id: int, method: str, reason: str, error: str) -> StageRpcError:
        return StageRpcError(stage_id=self.stage_id, replica_id=replica_id, method=method, reason=reason, error=error)

    async def collective_rpc_all(self, method: str, timeout: float | None = None, args: tuple | None = None,
                                 kwargs: dict[str, Any] | None = None) -> list[Any]:
        return list(await asyncio.gather(*(self.collective_rpc(i, method, timeout, args, kwargs)
                                           for i in range(len(self.clients)))))


def _replica_state(client: StageClientBase | None) -> str:
    if client is None:
        return "not_attached"
    if client.is_dead:
        return "dead"
    # `is_restarting` is StageClientBase's (False unless a stage restarts its workers); duck-typed clients may
    # leave it out.
    return "restarting" if getattr(client, "is_restarting", False) else "serving"
