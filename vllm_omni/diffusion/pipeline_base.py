"""The native diffusion pipeline skeleton: diffusers' `__call__` as one fixed template over groups of requests.

`forward(batch, ctx)` validates and groups the requests (a request invalid alone fails alone), then runs each
group as

    state = prepare(requests, ctx)      # encode prompt -> initial latents -> scheduler/timesteps -> step tables
    while not state.done:
        drop the aborted requests' rows
        denoise_step(state, ctx)        # transformer forward with CFG -> scheduler step -> progress
    finish(state, ctx)                  # decode -> one output per request

A family overrides named hooks (`group_key`, `check_inputs`, `encode_prompt`, `prepare_latents`,
`make_scheduler`, `prepare_step_tables`, `step_inputs`, `forward_step_inputs`, `guide`, `step_group_key`,
`step_tokens`, `scheduler_step`, `decode`), never the loop. All per-request state lives in a `DenoiseState`,
none on the pipeline, so that the worker's step executor (`vllm_omni/diffusion/worker/step_runner.py`) can
advance many states one step at a time.

A step's prediction is `guide(state, forward_step_inputs([step_inputs(state)])[0])`: the state's transformer
rows at its own step, one transformer forward, its own guidance. The step executor runs states with equal
`step_group_key`s through `denoise_step_batch`, which concatenates their rows into ONE forward and splits the
prediction back, so co-batched and solo steps share every line of arithmetic but the batching.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Self

import torch
from torch import nn
from tqdm.auto import tqdm

from vllm_omni.diffusion.cache.runtime import cache_group, cache_state_for, request_policy
from vllm_omni.diffusion.cache.state import CacheState
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.layers.compile import accelerated_forwards
from vllm_omni.diffusion.previews import emit_previews
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.timing import elapsed_since, synchronized_now
from vllm_omni.diffusion.warmup import batch_buckets, step_bucket
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.errors import OmniClientError, RequestAbortedError


class Conditioning(Protocol):
    """A family's per-group transformer inputs besides latents and timestep (text embeddings, CFG rows, ...)."""

    def select(self, rows: torch.Tensor) -> Self:
        """The conditioning of the latent rows `rows` only (indices into the current latent rows, in order)."""
        ...


@dataclass
class DenoiseState:
    """One group of co-batched requests from `prepare` to `finish`: everything a denoise step reads or advances.

    Latent rows are request-major: request `i` owns rows `i * outputs_per_request` up to the next request's.
    """

    requests: list[OmniDiffusionRequest]
    latents: torch.Tensor
    scheduler: Any
    """A fresh diffusers scheduler of this group only, its timesteps set."""
    conditioning: Conditioning
    outputs_per_request: int = 1
    durations: dict[str, float] = field(default_factory=dict)
    step_index: int = 0
    aborted: list[OmniDiffusionRequest] = field(default_factory=list)
    """Requests dropped by an abort; they leave with `RequestAbortedError`."""
    timesteps: torch.Tensor = field(init=False)
    normalized_timesteps: list[float] = field(init=False)
    """Host copy of the timesteps in [0, 1] (1.0 = pure noise), read once instead of syncing every step."""
    cache: CacheState = field(default_factory=CacheState)
    """This group's cache policy, residuals and counters (docs/cache.md); the default caches nothing."""

    def __post_init__(self) -> None:
        self.timesteps = self.scheduler.timesteps
        num_train = self.scheduler.config.get("num_train_timesteps", 1000)
        self.normalized_timesteps = [t / num_train for t in self.timesteps.tolist()]

    @property
    def done(self) -> bool:
        return not self.requests or self.step_index >= len(self.timesteps)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    def drop(self, request_ids: set[str]) -> None:
        """Remove the requests `request_ids`, their latent and conditioning rows; the other rows are unchanged."""
        keep = [i for i, r in enumerate(self.requests) if r.request_id not in request_ids]
        if len(keep) == len(self.requests):
            return
        self.aborted += [r for r in self.requests if r.request_id in request_ids]
        self.requests = [self.requests[i] for i in keep]
        self.cache.invalidate()  # its residuals hold the dropped rows too: the next step computes
        if not keep:
            self.latents = self.latents[:0]
            return
        per = self.outputs_per_request
        rows = torch.tensor([i * per + j for i in keep for j in range(per)], device=self.latents.device)
        self.latents = self.latents.index_select(0, rows)
        self.conditioning = self.conditioning.select(rows)
        _select_scheduler_rows(self.scheduler, rows)


class NativeDiffusionPipeline(nn.Module):
    """Base of the native pipelines; subclasses set `od_config` and `device` and implement the hooks."""

    supports_request_batch: ClassVar[bool] = True
    supports_step_execution: ClassVar[bool] = True
    """The step executor drives `prepare` / `denoise_step` / `finish` itself; a family whose loop needs more
    than these hooks (e.g. an override of `denoise`) sets it False."""
    progress_desc: ClassVar[str] = "denoise"
    od_config: OmniDiffusionConfig
    device: torch.device

    # ---- the template --------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, batch: DiffusionRequestBatch, ctx: StepContext | None = None) -> list[DiffusionOutput]:
        """One output per request, in batch order (`ctx` None: used standalone, nobody listens or aborts).

        Requests with equal `group_key`s share every transformer forward; each group runs to the end alone.
        """
        ctx = ctx or StepContext(self.od_config, request_ids=batch.request_ids)
        outputs: dict[int, DiffusionOutput] = {}  # by id(request): request ids need not be unique here
        groups: dict[Any, list[OmniDiffusionRequest]] = {}
        for request in batch.requests:
            try:
                key = (self.group_key(request), cache_group(self.cache_policy(request), request))
                groups.setdefault(key, []).append(request)
            except OmniClientError as exc:
                outputs[id(request)] = DiffusionOutput.from_exception(exc)
        for requests in groups.values():
            outputs.update(self.run_group(requests, ctx))
        return [outputs[id(request)] for request in batch.requests]

    def run_group(self, requests: list[OmniDiffusionRequest], ctx: StepContext) -> dict[int, DiffusionOutput]:
        """prepare -> denoise -> finish for one group; a shared parameter found invalid fails the whole group."""
        aborted = set(ctx.aborted([r.request_id for r in requests]))
        outputs = {id(r): _aborted_output() for r in requests if r.request_id in aborted}
        requests = [r for r in requests if r.request_id not in aborted]
        if not requests:
            return outputs
        try:
            state = self.prepare(requests, ctx)
            self.denoise(state, ctx)
            finished = self.finish(state, ctx) if state.requests else []
        except OmniClientError as exc:
            return outputs | {id(r): DiffusionOutput.from_exception(exc) for r in requests}
        outputs.update((id(r), _aborted_output()) for r in state.aborted)
        outputs.update(zip(map(id, state.requests), finished, strict=True))
        return outputs

    def prepare(self, requests: list[OmniDiffusionRequest], ctx: StepContext) -> DenoiseState:
        """Everything before the first step: prompt embeddings, initial latents, scheduler, per-step tables."""
        refuse_pipeline_kwargs(requests)
        self.check_inputs(requests)
        start = time.perf_counter()
        conditioning = self.encode_prompt(requests)
        durations = {"text_encoder": elapsed_since(start, self.device)}
        latents = self.prepare_latents(requests, conditioning)
        state = DenoiseState(requests, latents, self.make_scheduler(requests, latents), conditioning,
                             outputs_per_request=requests[0].sampling_params.num_outputs_per_prompt,
                             durations=durations)
        self.prepare_step_tables(state)
        state.cache = cache_state_for(self.cache_policy(requests[0]), self.cache_transformers, len(state.timesteps))
        return state

    def denoise(self, state: DenoiseState, ctx: StepContext) -> None:
        """All steps of `state`; an aborted request leaves before the next step (or before decode)."""
        start = time.perf_counter()
        total = len(state.timesteps)
        with tqdm(total=total, desc=self.progress_desc, disable=not self.od_config.enable_progress_bar) as bar:
            while not state.done:
                state.drop(set(ctx.aborted(state.request_ids)))
                if state.requests:
                    self.denoise_step(state, ctx)
                    bar.update()
        ctx.step_index = ctx.timestep = None
        state.drop(set(ctx.aborted(state.request_ids)))
        state.durations["denoise"] = elapsed_since(start, self.device)

    def denoise_step(self, state: DenoiseState, ctx: StepContext) -> None:
        """One step over every row of `state`: transformer forward with CFG, scheduler step, progress."""
        _enter_step(state, ctx)
        self.advance(state, ctx, self.predict_noise(state))

    def denoise_step_batch(self, states: list[DenoiseState], ctxs: list[StepContext]) -> list[Exception | None]:
        """One step of each of `states` (equal `step_group_key`s) with ONE transformer forward over all their
        rows; each state then takes its own guidance and scheduler step. Returns each state's error (None: it
        advanced). A state whose inputs or guidance raise fails alone; when the shared forward raises, whose
        fault it is cannot be told, so each state retries the step with a forward of its own."""
        if len(states) == 1:
            return [_attempt(lambda: self.denoise_step(states[0], ctxs[0]))]
        errors: list[Exception | None] = [None] * len(states)
        inputs: dict[int, Any] = {}
        for i, (state, ctx) in enumerate(zip(states, ctxs, strict=True)):
            _enter_step(state, ctx)
            try:
                inputs[i] = self.step_inputs(state)
            except Exception as exc:
                errors[i] = exc
        live = list(inputs)
        if not live:
            return errors
        try:
            batch = [inputs[i] for i in live]
            # Compiled path: run as the next captured batch bucket (the last inputs repeated, their rows dropped),
            # so no composition of states compiles or captures while serving (diffusion/warmup.py).
            padding = [batch[-1]] * (step_bucket(len(batch), self.step_buckets) - len(batch))
            preds = self.forward_step_inputs(batch + padding, [states[i] for i in live])[:len(batch)]
        except Exception as exc:
            if len(live) == 1:
                errors[live[0]] = exc
            else:
                for i in live:
                    errors[i] = _attempt(lambda i=i: self.denoise_step(states[i], ctxs[i]))
            return errors
        for i, pred in zip(live, preds, strict=True):
            errors[i] = _attempt(lambda i=i, pred=pred: self.advance(states[i], ctxs[i], self.guide(states[i], pred)))
        return errors

    @property
    def step_buckets(self) -> list[int]:
        """Batch sizes a co-batched step forward is padded up to: the warm-up's buckets on the compiled path,
        none (no padding) when every DiT runs eager."""
        if "_step_buckets" not in self.__dict__:
            compiled = bool(accelerated_forwards(self))
            self.__dict__["_step_buckets"] = batch_buckets(self.od_config.max_num_seqs) if compiled else []
        return self.__dict__["_step_buckets"]

    def advance(self, state: DenoiseState, ctx: StepContext, noise_pred: torch.Tensor) -> None:
        """The scheduler step of `state` with its guided prediction, then progress and any asked-for preview."""
        latents_before = state.latents
        state.latents = self.scheduler_step(state, noise_pred)
        state.step_index += 1
        ctx.report_progress(state.step_index, len(state.timesteps), state.request_ids)
        emit_previews(self, state, ctx, latents_before, noise_pred)

    def finish(self, state: DenoiseState, ctx: StepContext) -> list[DiffusionOutput]:
        """Decode and split: one output per remaining request, `outputs_per_request` items each.

        A family that decodes in chunks (video) overrides this and may `state.drop` aborted requests between
        chunks; it returns one output per request still in `state.requests` at the end.
        """
        start = synchronized_now(self.device)  # step mode: the last steps may still be queued
        decoded = self.decode(state)
        state.durations["vae_decode"] = elapsed_since(start, self.device)
        per = state.outputs_per_request
        return [DiffusionOutput(output=decoded[i * per:(i + 1) * per], stage_durations=dict(state.durations),
                                extra=self.output_extra(state))
                for i in range(len(state.requests))]

    def output_extra(self, state: DenoiseState) -> dict[str, Any]:
        """Metadata every output of `state` carries: what its cache ran."""
        return {"cache": state.cache.summary()}

    # ---- cache ---------------------------------------------------------------------------------------------

    @property
    def cache_transformer(self) -> nn.Module | None:
        """The DiT whose class picks the cache presets (docs/cache.md); None = no cache hooks."""
        return getattr(self, "transformer", None)

    @property
    def cache_transformers(self) -> dict[str, nn.Module]:
        """Every DiT a step may run, by the slot name `predict_noise` gives `call_transformer`."""
        return {name: getattr(self, name) for name in ("transformer", "transformer_2")
                if getattr(self, name, None) is not None}

    def cache_policy(self, request: OmniDiffusionRequest):
        """The request's cache policy on this stage (OmniClientError naming the field when it has none)."""
        return request_policy(self.od_config, self.cache_transformer, request.sampling_params)

    # ---- hooks ---------------------------------------------------------------------------------------------

    def group_key(self, request: OmniDiffusionRequest) -> Any:
        """Validates one request (OmniClientError naming the field); requests with equal keys run together."""
        raise NotImplementedError

    def check_inputs(self, requests: list[OmniDiffusionRequest]) -> None:
        """Validates what the group shares (raise OmniClientError); the group then fails as a whole."""

    def encode_prompt(self, requests: list[OmniDiffusionRequest]) -> Conditioning:
        raise NotImplementedError

    def prepare_latents(self, requests: list[OmniDiffusionRequest], conditioning: Conditioning) -> torch.Tensor:
        """Initial noise, `outputs_per_request` rows per request, each request drawn from its own seed."""
        raise NotImplementedError

    def make_scheduler(self, requests: list[OmniDiffusionRequest], latents: torch.Tensor) -> Any:
        """A fresh scheduler for this group with its timesteps set."""
        raise NotImplementedError

    def prepare_step_tables(self, state: DenoiseState) -> None:
        """Per-step inputs computed once from the timesteps (e.g. every step's adaLN modulation)."""

    def predict_noise(self, state: DenoiseState) -> torch.Tensor:
        """The guided prediction for `state.latents` at `state.step_index` (one transformer forward with CFG)."""
        return self.guide(state, self.forward_step_inputs([self.step_inputs(state)], [state])[0])

    def forward_group_key(self, state: DenoiseState) -> Hashable | None:
        """What the step executor groups by: the family's `step_group_key`, and None (alone) while the state's
        cache does any work at this step, since cache decisions and residuals are per state."""
        if state.cache.step_signature(state.step_index) is not None:
            return None
        return self.step_group_key(state)

    def step_group_key(self, state: DenoiseState) -> Hashable | None:
        """States with equal keys may share this step's transformer forward (`denoise_step_batch`): same token
        shapes, same transformer, same dtype. None: this state's step always runs alone."""
        return None

    def step_tokens(self, state: DenoiseState) -> int:
        """Tokens this state's step adds to a forward: transformer rows (CFG included) x sequence length."""
        return state.latents.shape[0]

    def step_inputs(self, state: DenoiseState) -> Any:
        """The transformer inputs of this state's rows (CFG rows included) at its own step (its timestep, its
        row of the step tables)."""
        raise NotImplementedError

    def forward_step_inputs(self, inputs: list[Any], states: list[DenoiseState]) -> list[torch.Tensor]:
        """ONE transformer forward over the rows of all `inputs` (text padded to the longest where the
        transformer takes per-row text lengths); the raw prediction rows of each input, in order. `states` are
        the inputs' states, for their caches (`call_transformer_rows`)."""
        raise NotImplementedError

    def guide(self, state: DenoiseState, pred: torch.Tensor) -> torch.Tensor:
        """This state's guided prediction from its raw prediction rows (CFG combination, its own scale)."""
        return pred

    def scheduler_step(self, state: DenoiseState, noise_pred: torch.Tensor) -> torch.Tensor:
        t = state.timesteps[state.step_index]
        return state.scheduler.step(noise_pred, t, state.latents, return_dict=False)[0]

    def decode(self, state: DenoiseState) -> Any:
        """Final latents -> a sequence with one item per latent row (images, arrays, or latents)."""
        raise NotImplementedError


def _enter_step(state: DenoiseState, ctx: StepContext) -> None:
    ctx.step_index, ctx.timestep = state.step_index, state.normalized_timesteps[state.step_index]


def _attempt(fn: Callable[[], object]) -> Exception | None:
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def refuse_pipeline_kwargs(requests: list[OmniDiffusionRequest]) -> None:
    """`lora` and `extra_args` (e.g. {"sigmas": [...]}) are diffusers `__call__` arguments that only the generic
    diffusers adapter passes on; a native pipeline refuses them rather than run without them."""
    for request in requests:
        sp = request.sampling_params
        for name in ("lora", "extra_args"):
            if getattr(sp, name):
                raise OmniClientError(f"{name}={getattr(sp, name)!r} is not supported by vllm-omni's native "
                                      "pipelines (the generic diffusers adapter passes it to the diffusers "
                                      "pipeline)", param=name)


def _aborted_output() -> DiffusionOutput:
    return DiffusionOutput.from_exception(RequestAbortedError())


_SCHEDULER_ROW_STATE = ("model_outputs", "last_sample")
"""Per-row history that diffusers' multistep schedulers (UniPC for Wan, DPM-Solver) keep between steps."""


def _select_scheduler_rows(scheduler: Any, rows: torch.Tensor) -> None:
    """Keep only latent rows `rows` in the scheduler's per-row history (stateless schedulers have none)."""
    for name in _SCHEDULER_ROW_STATE:
        value = getattr(scheduler, name, None)
        if isinstance(value, torch.Tensor):
            setattr(scheduler, name, value.index_select(0, rows))
        elif isinstance(value, list):
            setattr(scheduler, name, [v.index_select(0, rows) if isinstance(v, torch.Tensor) else v for v in value])
