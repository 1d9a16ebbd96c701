"""Cross-stage request state: routes stage i -> i+1, orders final outputs, handles abort and control RPC.

Runs on the caller's event loop (as vLLM's `AsyncLLM`): each request is a task on that loop, its outputs go
to the sink the caller gave (`OutputSink`), in order. It never picks models or placement.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_omni.config.omni_config import VllmOmniConfig
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.connectors.base import OmniConnector, PayloadHandle, StagePayload, make_connector
from vllm_omni.engine.stage_input_processors import StageInputContext, get_stage_input_processor, processor_reads
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.errors import EngineDeadError, EngineGenerateError, OmniClientError, OmniError, StageRestartingError
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OmniRequestOutput

logger = init_logger(__name__)

DEATH_POLL_INTERVAL_S = 0.5

OutputSink = Callable[[OmniRequestOutput | BaseException], None]
"""Takes one request's outputs in order, then at most one exception (the request failed; nothing follows)."""


@dataclass
class OrchestratorRequestState:
    request_id: str
    sink: OutputSink
    task: asyncio.Task | None = None
    current_stage: int = 0
    handles: dict[tuple[int, int], PayloadHandle] = field(default_factory=dict)
    chunks_sent: dict[tuple[int, int], int] = field(default_factory=dict)
    """Streamed edge (src, dst) -> chunks put on it so far (their connector keys)."""
    stage_durations: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
    arrival_time: float = 0.0


@dataclass
class _StreamedEdge:
    """One request's streamed edge: the chunks put on it, and whether its stream-fed AR stage has consumed
    them all and waits (then the upstream hands on its newest tokens without waiting for `chunk_tokens`)."""

    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    wanted: asyncio.Event = field(default_factory=asyncio.Event)


class Orchestrator:
    def __init__(self, stage_pools: list[StagePool], config: VllmOmniConfig | None = None,
                 stage_modalities: list[str] | None = None) -> None:
        """`stage_modalities`: the output modality of each stage (for requests that ask for some of them)."""
        self.stage_pools = stage_pools
        self.stages = config.stages if config is not None else None
        self.request_states: dict[str, OrchestratorRequestState] = {}
        self.connectors: dict[tuple[int, int], OmniConnector] = {}
        if config is not None:
            for stage in config.stages:
                for src in stage.inputs:
                    self.connectors[(src, stage.stage_id)] = make_connector(config.connector_for(src, stage.stage_id))
        self._downstream = {i: [s.stage_id for s in (self.stages or []) if i in s.inputs]
                            for i in range(len(stage_pools))}
        self.stage_modalities = stage_modalities
        self._last_final_stage = max((i for i in range(len(stage_pools)) if self._is_final(i)), default=0)
        self.dead_error: str | None = None
        self._monitor: asyncio.Task | None = None
        self._aborting: set[asyncio.Task] = set()
        """Aborts nobody waits for (kept referenced until they end)."""

    # ---- lifecycle -------------------------------------------------------------------------------------
    def start_monitor(self) -> None:
        """Watch the stages' liveness from the running loop (the one that drives the stages)."""
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._monitor_stages(), name="omni-stage-monitor")

    def close(self) -> None:
        """Stop every request and the monitor, and free the connectors (on the loop, or after it ended)."""
        tasks = [state.task for state in self.request_states.values()] + [self._monitor]
        for task in tasks:
            if task is not None and not task.done():
                task.cancel()
        self.request_states.clear()
        for connector in self.connectors.values():
            connector.close()

    def add_request(self, request_id: str, prompt: Any, sampling_params_list: list[Any], sink: OutputSink,
                    output_modalities: list[str] | None = None, arrival_time: float | None = None) -> None:
        """Start the request on the running loop; its outputs (or its error) go to `sink`."""
        rid = request_id
        if self.dead_error is not None:
            sink(EngineDeadError(self.dead_error))
            return
        if rid in self.request_states:
            sink(OmniClientError(f"request id {rid!r} is already in flight", param="request_id"))
            return
        if len(sampling_params_list) != len(self.stage_pools):
            sink(OmniClientError(
                f"sampling_params_list has {len(sampling_params_list)} entries but the pipeline has "
                f"{len(self.stage_pools)} stages", param="sampling_params_list"))
            return
        state = OrchestratorRequestState(rid, sink, arrival_time=arrival_time or time.time())
        self.request_states[rid] = state
        state.task = asyncio.create_task(self._run_request(state, prompt, list(sampling_params_list),
                                                           output_modalities))

    # ---- one request through the stage graph -----------------------------------------------------------
    async def _run_request(self, state: OrchestratorRequestState, prompt: Any, params_list: list[Any],
                           output_modalities: list[str] | None) -> None:
        rid = state.request_id
        msg = _Request(prompt, params_list)
        try:
            last_stage = self._last_stage(output_modalities)
            if any(self._streamed_source(i) is not None for i in range(last_stage + 1)):
                await self._run_streamed(state, msg, last_stage)
            else:
                for stage_id in range(last_stage + 1):
                    state.current_stage = stage_id
                    prompt, params = self._stage_input(state, stage_id, msg.prompt,
                                                       msg.params_list[stage_id])
                    await self._run_segment(state, stage_id, prompt, params, last_stage, {})
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._mark_dead(str(e))
            self._emit_error(state, e)
        except Exception as e:
            logger.info("[Orchestrator] request %s failed in stage %d: %s", rid, state.current_stage, e)
            self._emit_error(state, e)
        finally:
            self._drop_payloads(rid)
            if self.request_states.get(rid) is state:
                del self.request_states[rid]

    async def _run_streamed(self, state: OrchestratorRequestState, msg: _Request, last_stage: int) -> None:
        """Every stage of the request runs as its own task: a streamed edge's chunks go through its connector
        and a queue while the upstream runs; other edges wait for the upstream to finish. The first failure
        cancels every stage (cancelling vLLM's `generate` aborts the request in its EngineCore)."""
        edges = {(src, dst): _StreamedEdge() for dst in range(last_stage + 1)
                 if (src := self._streamed_source(dst)) is not None}
        done = [asyncio.Event() for _ in range(last_stage + 1)]
        tasks = [asyncio.create_task(self._stage_task(state, msg, i, last_stage, edges, done))
                 for i in range(last_stage + 1)]
        try:
            finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in finished:
                if task.exception() is not None:
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stage_task(self, state: OrchestratorRequestState, msg: _Request, stage_id: int,
                          last_stage: int, edges: dict[tuple[int, int], _StreamedEdge],
                          done: list[asyncio.Event]) -> None:
        try:
            stage = self.stages[stage_id]
            src = self._streamed_source(stage_id)
            for upstream in stage.inputs:
                if upstream != src:
                    await done[upstream].wait()
            params = msg.params_list[stage_id]
            if src is None:
                prompt, params = self._stage_input(state, stage_id, msg.prompt, params)
                await self._run_segment(state, stage_id, prompt, params, last_stage, edges)
            elif stage.kind is StageKind.AR:
                await self._run_input_stream(state, stage_id, src, msg.prompt, params, last_stage, edges)
            else:
                await self._run_chunks(state, stage_id, src, msg.prompt, params, last_stage, edges)
            done[stage_id].set()
        except Exception:
            state.current_stage = stage_id
            raise

    async def _run_chunks(self, state: OrchestratorRequestState, stage_id: int, src: int, original_prompt: Any,
                          params: Any, last_stage: int, edges: dict[tuple[int, int], _StreamedEdge]) -> None:
        """A streamed stage: each upstream chunk goes through the input processor; what it returns runs as one
        segment of the request, in order; the segment made from the final chunk ends the stage."""
        stage = self.stages[stage_id]
        context = StageInputContext(request_id=state.request_id, stage=stage, sampling_params=params,
                                    edge=stage.stream_inputs[src])
        process = get_stage_input_processor(stage.input_processor)
        connector = self.connectors[(src, stage_id)]
        segments: list[OmniRequestOutput] = []
        while True:
            handle, context.final = await edges[(src, stage_id)].chunks.get()
            result = process([connector.get(handle)], original_prompt, context)
            if result is None:
                if context.final:
                    raise RuntimeError(f"stage {stage_id}: the input processor made nothing of the final chunk")
                continue
            context.sampling_params = result.sampling_params
            await self._run_segment(state, stage_id, result.prompt, result.sampling_params, last_stage, edges,
                                    segments=segments, final_segment=context.final)
            if context.final:
                return

    async def _run_segment(self, state: OrchestratorRequestState, stage_id: int, prompt: Any, params: Any,
                           last_stage: int, edges: dict[tuple[int, int], _StreamedEdge],
                           segments: list[OmniRequestOutput] | None = None, final_segment: bool = True,
                           observe: Callable[[OmniRequestOutput], None] | None = None) -> None:
        """Run the request (or one segment of it) on the stage; emit its final outputs; feed its downstream
        edges: streamed ones after `first_chunk_tokens`, then every `chunk_tokens` tokens (or at once when their
        stage waits for input) and at the end, the others once it finished.
        `observe` sees each output first (a stream-fed stage: makes its token ids cumulative)."""
        pool = self.stage_pools[stage_id]
        streamed = {dst: self.stages[dst].stream_inputs[stage_id] for (src, dst) in edges if src == stage_id}
        finals_only = False
        if streamed and pool.kind is StageKind.AR and params is not None and observe is None:
            from vllm.sampling_params import RequestOutputKind  # chunks need vLLM's incremental outputs

            finals_only = params.output_kind == RequestOutputKind.FINAL_ONLY  # what the caller asked for
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.CUMULATIVE
        sent = dict.fromkeys(streamed, 0)
        once = {dst: processor_reads(self.stages[dst].input_processor).partial_stage_data == "first_chunk"
                for dst in streamed}
        last = None
        async for out in pool.generate(state.request_id, prompt, params):
            if observe is not None:
                observe(out)
            last = out
            for dst, edge in streamed.items():
                new = len(out.token_ids) - sent[dst]
                due = edge.first_hand_off() if sent[dst] == 0 else edge.chunk_tokens
                if not out.finished and new > 0 and (new >= due or edges[(stage_id, dst)].wanted.is_set()):
                    collect = sent[dst] == 0 or not once[dst]
                    sent[dst] = len(out.token_ids)
                    edges[(stage_id, dst)].wanted.clear()
                    out.multimodal_output["stage_data"] = (await pool.partial_stage_data(state.request_id, out)
                                                           if collect else {})
                    self._put_chunk(state, stage_id, dst, out, edges, final=False)
            if self._is_final(stage_id) and (out.finished or not finals_only):
                self._emit_output(state, stage_id, self._segment_output(out, segments, final_segment), last_stage)
        if last is None:
            raise RuntimeError(f"stage {stage_id} finished request {state.request_id} without an output")
        self._record_stage(state, last)
        if not final_segment:
            return
        for dst in streamed:
            self._put_chunk(state, stage_id, dst, last, edges, final=True)
        self._hand_off(state, stage_id, last, last_stage, skip=set(streamed))

    async def _run_input_stream(self, state: OrchestratorRequestState, stage_id: int, src: int,
                                original_prompt: Any, params: Any, last_stage: int,
                                edges: dict[tuple[int, int], _StreamedEdge]) -> None:
        """An AR stage fed while its upstream runs, as one vLLM streaming-input request: each time an upstream
        chunk arrives or the stage has consumed its last input (it waits), the input processor may make the
        next input chunk from the upstream output so far and the stage's own output so far (None: not yet); a
        `StageInput` with no prompt closes the input, and vLLM then finishes the request."""
        from vllm.engine.protocol import StreamingInput
        from vllm.sampling_params import RequestOutputKind

        stage = self.stages[stage_id]
        context = StageInputContext(request_id=state.request_id, stage=stage, sampling_params=params,
                                    edge=stage.stream_inputs[src], final=False)
        process = get_stage_input_processor(stage.input_processor)
        chunks: asyncio.Queue = asyncio.Queue()
        idle = asyncio.Event()

        async def feed() -> None:
            upstream = edges[(src, stage_id)]
            payload, arrival = None, asyncio.ensure_future(upstream.chunks.get())
            try:
                while True:
                    waiting = asyncio.ensure_future(idle.wait())
                    await asyncio.wait({arrival, waiting}, return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                    if arrival.done():
                        handle, context.final = arrival.result()
                        payload = self.connectors[(src, stage_id)].get(handle)
                        arrival = (asyncio.get_running_loop().create_future() if context.final
                                   else asyncio.ensure_future(upstream.chunks.get()))
                    idle.clear()
                    result = process([payload], original_prompt, context)
                    if result is None:
                        if context.idle:  # waits for input: the upstream hands on its next token at once
                            upstream.wanted.set()
                        continue
                    context.idle = False
                    if result.prompt is None:
                        chunks.put_nowait(None)
                        return
                    sampling = copy.copy(result.sampling_params)
                    sampling.output_kind = RequestOutputKind.DELTA
                    chunks.put_nowait(StreamingInput(result.prompt, sampling))
            except Exception as e:  # fails the vLLM request through its input stream
                chunks.put_nowait(e)
            finally:
                arrival.cancel()

        async def inputs():
            while (item := await chunks.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item

        def observe(out: OmniRequestOutput) -> None:
            context.output_token_ids += out.token_ids
            out.token_ids = list(context.output_token_ids)
            completion = out.request_output.outputs[0] if out.request_output and out.request_output.outputs else None
            if not out.finished and completion is not None and completion.finish_reason is not None:
                context.idle = True
                idle.set()
                edges[(src, stage_id)].wanted.set()

        feeder = asyncio.create_task(feed())
        try:
            stream = inputs()
            first = await anext(stream)
            await self._run_segment(state, stage_id, _prepend(first, stream), first.sampling_params, last_stage,
                                    edges, observe=observe)
        finally:
            feeder.cancel()

    @staticmethod
    def _segment_output(out: OmniRequestOutput, segments: list[OmniRequestOutput] | None,
                        final_segment: bool) -> OmniRequestOutput:
        """A streamed stage's segment outputs are partial outputs carrying their own audio as `audio_chunk`; the
        last one also carries the whole waveform as `audio` (what non-streaming callers read)."""
        media = out.multimodal_output
        if segments is None or "audio" not in media:
            if "audio" in media:
                media.setdefault("audio_chunk", media["audio"])
            return out
        media["audio_chunk"] = media["audio"]
        if segments:  # the stage's time so far: its segments' times added up
            previous = segments[-1].stage_durations
            out.stage_durations = {k: v + previous.get(k, 0.0) for k, v in out.stage_durations.items()}
        segments.append(out)
        if final_segment:
            media["audio"] = np.concatenate([s.multimodal_output["audio_chunk"] for s in segments])
        else:
            del media["audio"]
            out.finished = False
        return out

    def _is_final(self, stage_id: int) -> bool:
        if self.stages is None:
            return stage_id == len(self.stage_pools) - 1
        return self.stages[stage_id].final_output

    def _last_stage(self, modalities: list[str] | None) -> int:
        """The last stage a request runs: the last final stage, or the last one making a requested modality."""
        if modalities is None or self.stage_modalities is None:
            return self._last_final_stage
        finals = [i for i in range(len(self.stage_pools)) if self._is_final(i)]
        wanted = [i for i in finals if self.stage_modalities[i] in modalities]
        if not wanted:
            available = sorted({self.stage_modalities[i] for i in finals})
            raise OmniClientError(f"modalities {sorted(modalities)} cannot be produced by this pipeline "
                                  f"(it outputs {available})", param="modalities")
        return max(wanted)

    def _stage_input(self, state: OrchestratorRequestState, stage_id: int, original_prompt: Any,
                     params: Any) -> tuple[Any, Any]:
        """(prompt, sampling params) of this request for `stage_id`."""
        if self.stages is None or not self.stages[stage_id].inputs:
            return original_prompt, params
        stage = self.stages[stage_id]
        payloads = [self.connectors[(src, stage_id)].get(state.handles.pop((src, stage_id)))
                    for src in stage.inputs]
        edge = stage.stream_inputs.get(stage.inputs[0]) if len(stage.inputs) == 1 else None
        context = StageInputContext(request_id=state.request_id, stage=stage, sampling_params=params, edge=edge)
        result = get_stage_input_processor(stage.input_processor)(payloads, original_prompt, context)
        return result.prompt, result.sampling_params

    def _hand_off(self, state: OrchestratorRequestState, stage_id: int, out: OmniRequestOutput,
                  last_stage: int, skip: set[int] = frozenset()) -> None:
        for dst in self._downstream.get(stage_id, ()):
            if dst > last_stage or dst in skip:
                continue
            state.handles[(stage_id, dst)] = self.connectors[(stage_id, dst)].put(state.request_id, stage_id, dst,
                                                                                   _payload(out))

    def _put_chunk(self, state: OrchestratorRequestState, src: int, dst: int, out: OmniRequestOutput,
                   edges: dict[tuple[int, int], _StreamedEdge], final: bool) -> None:
        chunk = state.chunks_sent.get((src, dst), 0)
        state.chunks_sent[(src, dst)] = chunk + 1
        handle = self.connectors[(src, dst)].put(state.request_id, src, dst, _payload(out), chunk=chunk)
        edges[(src, dst)].chunks.put_nowait((handle, final))

    def _streamed_source(self, stage_id: int) -> int | None:
        return self.stages[stage_id].streamed_input() if self.stages is not None else None

    def _record_stage(self, state: OrchestratorRequestState, out: OmniRequestOutput) -> None:
        state.stage_durations.update(out.stage_durations)
        state.peak_memory_mb = max(state.peak_memory_mb, out.peak_memory_mb)

    def _emit_output(self, state: OrchestratorRequestState, stage_id: int, out: OmniRequestOutput,
                     last_stage: int) -> None:
        if out.finished:
            state.stage_durations.update(out.stage_durations)
            out.stage_durations = dict(state.stage_durations)
            out.peak_memory_mb = max(state.peak_memory_mb, out.peak_memory_mb)
            out.stage_durations["e2e"] = time.time() - state.arrival_time
        out.finished = out.finished and stage_id == last_stage
        state.sink(out)

    @staticmethod
    def _emit_error(state: OrchestratorRequestState, exc: BaseException) -> None:
        state.sink(_request_error(exc))

    def _drop_payloads(self, request_id: str) -> None:
        for connector in self.connectors.values():
            connector.drop_request(request_id)

    # ---- abort -----------------------------------------------------------------------------------------
    async def abort(self, request_ids: list[str]) -> None:
        """Free the requests in every stage that holds them; return once each stage has (raises otherwise)."""
        await self._cleanup_request_ids(list(request_ids), abort=True)
        logger.debug("[Orchestrator] Aborted request(s) %s", request_ids)

    def abort_soon(self, request_ids: list[str]) -> None:
        """`abort` in a task of its own (the caller cannot wait: its own task is being cancelled)."""
        task = asyncio.create_task(self._abort_logged(request_ids))
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def _abort_logged(self, request_ids: list[str]) -> None:
        try:
            await self.abort(request_ids)
        except Exception:
            logger.exception("[Orchestrator] Abort failed for request(s) %s", request_ids)

    async def _cleanup_request_ids(self, request_ids: list[str], *, abort: bool = False) -> None:
        """Stop the requests' tasks, free them in every stage that holds them and drop their payloads."""
        for rid in request_ids:
            state = self.request_states.pop(rid, None)
            if abort:
                for pool in self.stage_pools:
                    if pool.active_replica(rid) is not None:
                        await pool.abort([rid])
            if state is not None and state.task is not None:
                state.task.cancel()
            self._drop_payloads(rid)

    # ---- control RPC and liveness ----------------------------------------------------------------------
    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None,
                             stage_ids: list[int] | None = None) -> dict[int, list[Any]]:
        """Stage id -> one result per replica (the method's return value, or a `StageRpcError`)."""
        stage_ids = stage_ids if stage_ids is not None else list(range(len(self.stage_pools)))
        results = await asyncio.gather(*(self.stage_pools[sid].collective_rpc_all(method, timeout, args, kwargs)
                                         for sid in stage_ids))
        return dict(zip(stage_ids, results, strict=True))

    async def _monitor_stages(self) -> None:
        while self.dead_error is None:
            for pool in self.stage_pools:
                if pool.is_dead:
                    self._mark_dead(f"stage {pool.stage_id} ({pool.kind.stage_type}) died")
                    break
            await asyncio.sleep(DEATH_POLL_INTERVAL_S)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = reason
        logger.error("[Orchestrator] engine is dead: %s", reason)
        for state in list(self.request_states.values()):
            if state.task is not None:
                state.task.cancel()
            self._emit_error(state, EngineDeadError(reason))
        self.request_states.clear()


@dataclass
class _Request:
    prompt: Any
    params_list: list[Any]


def _request_error(exc: BaseException) -> BaseException:
    """What the caller of a failed request gets: client errors (with their field), the engine's death, a
    restarting stage's 503 as they are; any other failure as the request's own 500."""
    if isinstance(exc, OmniClientError | EngineDeadError | StageRestartingError | EngineGenerateError):
        return exc
    message = str(exc) or type(exc).__name__
    status = exc.status_code if isinstance(exc, OmniError) else 500
    if 400 <= status < 500:
        return OmniClientError(message, status_code=status, param=getattr(exc, "param", None))
    if status == StageRestartingError.status_code:
        return StageRestartingError(message)
    return EngineGenerateError(message)


def _payload(out: OmniRequestOutput) -> StagePayload:
    """What a stage hands on: its text and tokens (with the prompt's), collected stage data and tensors."""
    prompt_ids = getattr(out.request_output, "prompt_token_ids", None)
    return StagePayload(metadata={"text": out.text, "token_ids": list(out.token_ids),
                                  "prompt_token_ids": list(prompt_ids or []),
                                  "stage_data": out.multimodal_output.get("stage_data", {})},
                        tensors=dict(out.multimodal_output.get("tensors", {})))


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item
