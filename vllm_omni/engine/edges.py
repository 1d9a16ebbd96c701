"""One request's walk through the stage graph, and one driver per kind of input edge:

- `WholeOutputEdge`: the stage waits for its upstreams to finish and takes their whole outputs;
- `ChunkedInputEdge`: a non-AR stage runs one segment per chunk of its upstream's output, while it runs;
- `StreamedInputEdge`: an AR stage is one vLLM streaming-input request fed from its upstream while it runs.

Every driver runs its stage through `RequestWalk.run_stage`, which emits the stage's final outputs and feeds
its downstream edges (chunks to streamed ones, the whole output to the others).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_omni.catalog.edges import StageInputContext, processor_reads
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.connectors.base import PayloadHandle
from vllm_omni.engine.stage_graph import StageGraph
from vllm_omni.engine.stage_input_processors import get_stage_input_processor
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.outputs import OmniRequestOutput

OutputSink = Callable[[OmniRequestOutput | BaseException], None]
"""Takes one request's outputs in order, then at most one exception (the request failed; nothing follows)."""


@dataclass
class RequestState:
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
    unfinished_finals: set[int] = field(default_factory=set)
    """Final stages the request runs whose last output is not out yet: the stream ends with the last of them
    (a talker that stops first ends the audio while the thinker still writes)."""


@dataclass
class _StreamedEdge:
    """One request's streamed edge: the chunks put on it, and whether its stream-fed AR stage has consumed
    them all and waits (then the upstream hands on its newest tokens without waiting for `chunk_tokens`, once
    there are `idle_chunk_growth` x those handed on so far: `EdgeStreamConfig.hand_off_due`)."""

    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    wanted: asyncio.Event = field(default_factory=asyncio.Event)


class RequestWalk:
    """One request through stages 0..`last_stage`: in order when no edge streams, else every stage as its own
    task (a streamed edge's chunks flow while its upstream runs; the first failure cancels every stage, and
    cancelling vLLM's `generate` aborts the request in its EngineCore)."""

    def __init__(self, graph: StageGraph, pools: list[StagePool], state: RequestState, prompt: Any,
                 params_list: list[Any], last_stage: int) -> None:
        self.graph = graph
        self.pools = pools
        self.state = state
        self.prompt = prompt
        self.params_list = params_list
        self.last_stage = last_stage
        self.edges = {(src, dst): _StreamedEdge() for dst in range(last_stage + 1)
                      if (src := graph.streamed_source(dst)) is not None}
        state.unfinished_finals = {i for i in range(last_stage + 1) if graph.is_final(i)}

    async def run(self) -> None:
        if not self.edges:
            for stage_id in range(self.last_stage + 1):
                self.state.current_stage = stage_id
                await WholeOutputEdge.drive(self, stage_id)
            return
        done = [asyncio.Event() for _ in range(self.last_stage + 1)]
        tasks = [asyncio.create_task(self._stage_task(i, done)) for i in range(self.last_stage + 1)]
        try:
            finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in finished:
                if task.exception() is not None:
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _stage_task(self, stage_id: int, done: list[asyncio.Event]) -> None:
        try:
            stage = self.graph.stages[stage_id]
            src = self.graph.streamed_source(stage_id)
            for upstream in stage.inputs:
                if upstream != src:
                    await done[upstream].wait()
            if src is None:
                await WholeOutputEdge.drive(self, stage_id)
            elif stage.kind is StageKind.AR:
                await StreamedInputEdge.drive(self, stage_id, src)
            else:
                await ChunkedInputEdge.drive(self, stage_id, src)
            done[stage_id].set()
        except Exception:
            self.state.current_stage = stage_id
            raise

    # ---- one stage (or one segment of it) ----------------------------------------------------------------
    async def run_stage(self, stage_id: int, prompt: Any, params: Any,
                        segments: list[OmniRequestOutput] | None = None, final_segment: bool = True,
                        observe: Callable[[OmniRequestOutput], None] | None = None) -> None:
        """Run the request (or one segment of it) on the stage; emit its final outputs; feed its downstream
        edges: streamed ones after `first_chunk_tokens`, then every `chunk_tokens` tokens (sooner, by
        `idle_chunk_growth`, when their stage waits for input) and at the end, the others once it finished.
        `observe` sees each output first (a stream-fed stage: makes its token ids cumulative)."""
        graph, state, pool = self.graph, self.state, self.pools[stage_id]
        streamed = {dst: graph.stages[dst].stream_inputs[stage_id] for (src, dst) in self.edges if src == stage_id}
        finals_only = False
        if streamed and pool.kind is StageKind.AR and params is not None and observe is None:
            from vllm.sampling_params import RequestOutputKind  # chunks need vLLM's incremental outputs

            finals_only = params.output_kind == RequestOutputKind.FINAL_ONLY  # what the caller asked for
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.CUMULATIVE
        sent = dict.fromkeys(streamed, 0)
        once = {dst: processor_reads(graph.stages[dst].input_processor).partial_stage_data == "first_chunk"
                for dst in streamed}
        last = None
        async for out in pool.generate(state.request_id, prompt, params):
            if observe is not None:
                observe(out)
            last = out
            for dst, edge in streamed.items():
                new = len(out.token_ids) - sent[dst]
                waits = self.edges[(stage_id, dst)].wanted.is_set()
                if not out.finished and new >= edge.hand_off_due(sent[dst], waits):
                    collect = sent[dst] == 0 or not once[dst]
                    sent[dst] = len(out.token_ids)
                    self.edges[(stage_id, dst)].wanted.clear()
                    out.multimodal_output["stage_data"] = (await pool.partial_stage_data(state.request_id, out)
                                                           if collect else {})
                    self._put_chunk(stage_id, dst, out, final=False)
            if graph.is_final(stage_id) and (out.finished or not finals_only):
                self._emit(stage_id, _segment_output(out, segments, final_segment))
        if last is None:
            raise RuntimeError(f"stage {stage_id} finished request {state.request_id} without an output")
        state.stage_durations.update(last.stage_durations)
        state.peak_memory_mb = max(state.peak_memory_mb, last.peak_memory_mb)
        if not final_segment:
            return
        for dst in streamed:
            self._put_chunk(stage_id, dst, last, final=True)
        graph.hand_off(state.request_id, state.handles, stage_id, last, self.last_stage, skip=set(streamed))

    def _put_chunk(self, src: int, dst: int, out: OmniRequestOutput, final: bool) -> None:
        chunk = self.state.chunks_sent.get((src, dst), 0)
        self.state.chunks_sent[(src, dst)] = chunk + 1
        self.edges[(src, dst)].chunks.put_nowait((self.graph.put_chunk(self.state.request_id, src, dst, out, chunk),
                                                  final))

    def _emit(self, stage_id: int, out: OmniRequestOutput) -> None:
        state = self.state
        if out.finished:
            state.stage_durations.update(out.stage_durations)
            out.stage_durations = dict(state.stage_durations)
            out.peak_memory_mb = max(state.peak_memory_mb, out.peak_memory_mb)
            out.stage_durations["e2e"] = time.time() - state.arrival_time
            state.unfinished_finals.discard(stage_id)
        out.stage_finished = out.finished
        out.finished = out.finished and not state.unfinished_finals
        state.sink(out)


class WholeOutputEdge:
    """The stage takes its upstreams' whole outputs (the user's prompt for an entry stage)."""

    @staticmethod
    async def drive(walk: RequestWalk, stage_id: int) -> None:
        prompt, params = walk.graph.stage_input(walk.state.request_id, walk.state.handles, stage_id, walk.prompt,
                                                walk.params_list[stage_id])
        await walk.run_stage(stage_id, prompt, params)


class ChunkedInputEdge:
    """A streamed non-AR stage: each upstream chunk goes through the input processor; what it returns runs as one
    segment of the request, in order; the segment made from the final chunk ends the stage."""

    @staticmethod
    async def drive(walk: RequestWalk, stage_id: int, src: int) -> None:
        stage = walk.graph.stages[stage_id]
        context = StageInputContext(request_id=walk.state.request_id, stage=stage,
                                    sampling_params=walk.params_list[stage_id], edge=stage.stream_inputs[src])
        process = get_stage_input_processor(stage.input_processor)
        segments: list[OmniRequestOutput] = []
        while True:
            handle, context.final = await walk.edges[(src, stage_id)].chunks.get()
            result = process([walk.graph.get(src, stage_id, handle)], walk.prompt, context)
            if result is None:
                if context.final:
                    raise RuntimeError(f"stage {stage_id}: the input processor made nothing of the final chunk")
                continue
            context.sampling_params = result.sampling_params
            await walk.run_stage(stage_id, result.prompt, result.sampling_params, segments=segments,
                                 final_segment=context.final)
            if context.final:
                return


class StreamedInputEdge:
    """An AR stage fed while its upstream runs, as one vLLM streaming-input request: each time an upstream
    chunk arrives or the stage has consumed its last input (it waits), the input processor may make the
    next input chunk from the upstream output so far and the stage's own output so far (None: not yet); a
    `StageInput` with no prompt closes the input, and vLLM then finishes the request."""

    @staticmethod
    async def drive(walk: RequestWalk, stage_id: int, src: int) -> None:
        from vllm.engine.protocol import StreamingInput
        from vllm.sampling_params import RequestOutputKind

        stage = walk.graph.stages[stage_id]
        context = StageInputContext(request_id=walk.state.request_id, stage=stage,
                                    sampling_params=walk.params_list[stage_id], edge=stage.stream_inputs[src],
                                    final=False)
        process = get_stage_input_processor(stage.input_processor)
        upstream = walk.edges[(src, stage_id)]
        chunks: asyncio.Queue = asyncio.Queue()
        idle = asyncio.Event()

        async def feed() -> None:
            payload, arrival = None, asyncio.ensure_future(upstream.chunks.get())
            try:
                while True:
                    waiting = asyncio.ensure_future(idle.wait())
                    await asyncio.wait({arrival, waiting}, return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                    if arrival.done():
                        handle, context.final = arrival.result()
                        payload = walk.graph.get(src, stage_id, handle)
                        arrival = (asyncio.get_running_loop().create_future() if context.final
                                   else asyncio.ensure_future(upstream.chunks.get()))
                    idle.clear()
                    result = process([payload], walk.prompt, context)
                    if result is None:
                        if context.idle:  # waits for input: the upstream hands on its newest tokens sooner
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
                upstream.wanted.set()

        feeder = asyncio.create_task(feed())
        try:
            stream = inputs()
            first = await anext(stream)
            await walk.run_stage(stage_id, _prepend(first, stream), first.sampling_params, observe=observe)
        finally:
            feeder.cancel()


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


async def _prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item
