"""The native diffusion pipeline skeleton: diffusers' `__call__` as one fixed template over groups of requests.

`forward(batch, ctx)` validates and groups the requests (a request invalid alone fails alone), then runs each
group as

    state = prepare(requests, ctx)      # encode prompt -> initial latents -> scheduler/timesteps -> step tables
    while not state.done:
        drop the aborted requests' rows
        denoise_step(state, ctx)        # transformer forward with CFG -> scheduler step -> progress
    finish(state, ctx)                  # decode -> one output per request

A family overrides named hooks (`group_key`, `check_inputs`, `encode_prompt`, `prepare_latents`,
`make_scheduler`, `prepare_step_tables`, `step_inputs`, `transformer_forward`, `guide`, `step_group_key`,
`step_tokens`, `scheduler_step`, `decode`), never the loop. All per-request state lives in a `DenoiseState`,
none on the pipeline, so that the worker's step executor (`vllm_omni/diffusion/worker/step_runner.py`) can
advance many states one step at a time.

A step's prediction is `guide(state, forward_step_inputs([cfg_step_inputs(state)])[0])`: the state's transformer
rows at its own step, one transformer forward, its own guidance. The step executor runs states with equal
`step_group_key`s through `denoise_step_batch`, which concatenates their rows into ONE forward and splits the
prediction back, so co-batched and solo steps share every line of arithmetic but the batching.

The execution strategy is the skeleton's, not the family's: a family's step input is a dataclass whose
row-wise fields are declared with `rows()`, and `transformer_forward` maps one (possibly merged) input onto its
transformer's signature. The family gives its latent rows only, plus its prompt fields (`rows(text=True)`) for
every transformer row; under classifier-free guidance (`conditioning.cfg`) `cfg_step_inputs` appends the
unconditional rows and `guide` combines the two branches (`combine_cfg`). `forward_step_inputs` then
concatenates co-batched states' rows, or under CFG parallel keeps this rank's branch and gathers the other's,
and every transformer call goes through the cache (`cache/runtime.call_transformer_rows`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from vllm_omni.diffusion.cache.policy import FamilyPresets
from vllm_omni.diffusion.cache.runtime import cache_group, cache_state_for, call_transformer_rows, request_policy
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.distributed.sequence import cfg_branch_rows, cfg_gather_rows
from vllm_omni.diffusion.layers.compile import compiled_forwards
from vllm_omni.diffusion.lora import LoRACapacityError, LoRAManager, RowAdapters
from vllm_omni.diffusion.offload.components import ComponentOffloader
from vllm_omni.diffusion.previews import emit_previews
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.state import CFG, Conditioning, DenoiseState
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.diffusion.timing import elapsed_since, synchronized_now
from vllm_omni.diffusion.warmup import TEXT_BUCKETS, batch_buckets, step_bucket
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.errors import OmniClientError, RequestAbortedError
from vllm_omni.inputs.lora import LoRARef, parse_lora


class NativeDiffusionPipeline(nn.Module):
    """Base of the native pipelines; subclasses set `od_config` and `device` and implement the hooks."""

    supports_request_batch: ClassVar[bool] = True
    supports_step_execution: ClassVar[bool] = True
    """The step executor drives `prepare` / `denoise_step` / `finish` itself; a family whose loop needs more
    than these hooks (e.g. an override of `denoise`) sets it False."""
    progress_desc: ClassVar[str] = "denoise"
    compile_vae_decoder: ClassVar[bool] = False
    """On the compiled path, `self.vae`'s decoder runs compiled with channels_last convolutions
    (`layers/compile.py` `accelerate_decoder`); a family sets it once its decoder traces whole
    (tests/diffusion/layers/test_compile_decoder.py)."""
    lora_loader: ClassVar[str | None] = None
    """The family's diffusers LoRA loader mixin (`diffusers.loaders.<name>`), whose `lora_state_dict` reads and
    converts adapter files; None = the family takes no `lora`."""
    supports_two_stage: ClassVar[bool] = False
    """Whether the family has a two-stage variant (base pass, latent upsampler, refine pass) that the `two_stage`
    knob selects (LTX-2); the others refuse the knob."""
    cpu_offloader: ComponentOffloader | None = None
    """`--enable-cpu-offload`'s (`offload/components.apply_cpu_offload`): every transformer forward sends the
    text encoders and the VAE back to host memory first."""
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
                self.refuse_two_stage([request])
                key = (self.group_key(request), cache_group(self.cache_policy(request), request))
                self.load_loras([request])
                groups.setdefault(key, []).append(request)
            except OmniClientError as exc:
                outputs[id(request)] = DiffusionOutput.from_exception(exc)
        for group in groups.values():
            for requests in self._lora_chunks(group):
                outputs.update(self.run_group(requests, ctx))
        return [outputs[id(request)] for request in batch.requests]

    def _lora_chunks(self, requests: list[OmniDiffusionRequest]) -> list[list[OmniDiffusionRequest]]:
        """`requests` cut, in order, so that no chunk needs more adapters than stay resident (--max-loras)."""
        if self.lora_manager is None:
            return [requests]
        chunks: list[list[OmniDiffusionRequest]] = []
        needs: set[str | None] = set()
        for request in requests:
            mine = {ref.path for ref in self.request_adapters(request)}
            if not chunks or len(needs | mine) > self.lora_manager.max_loras:
                chunks.append([])
                needs = set()
            chunks[-1].append(request)
            needs |= mine
        return chunks

    def refuse_two_stage(self, requests: list[OmniDiffusionRequest]) -> None:
        """`two_stage` (or its `refine_lora`) on a family without the variant: a 400 naming it (per request in
        `forward`, which groups by the family's key; in `prepare` for step mode)."""
        if self.supports_two_stage:
            return
        for name in ("two_stage", "refine_lora"):
            if any(getattr(r.sampling_params, name) for r in requests):
                raise OmniClientError(f"{name}: {type(self).__name__} has no two-stage variant", param=name)

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
        self.refuse_two_stage(requests)
        self.load_loras(requests)
        self.check_inputs(requests)
        start = time.perf_counter()
        conditioning = self.encode_prompt(requests)
        durations = {"text_encoder": elapsed_since(start, self.device)}
        latents = self.prepare_latents(requests, conditioning)
        state = DenoiseState(requests, latents, self.make_scheduler(requests, latents), conditioning,
                             outputs_per_request=requests[0].sampling_params.num_outputs_per_prompt,
                             durations=durations)
        self.prepare_step_tables(state)
        state.cache = cache_state_for(self.cache_policy(requests[0]), self.cache_transformers, len(state.timesteps),
                                      self.cache_presets())
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
                inputs[i] = self.cfg_step_inputs(state)
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
    def compiled(self) -> bool:
        """Whether a DiT of this pipeline runs the compiled path (CUDA graphs per input signature)."""
        if "_compiled" not in self.__dict__:
            self.__dict__["_compiled"] = bool(compiled_forwards(self))
        return self.__dict__["_compiled"]

    @property
    def step_buckets(self) -> list[int]:
        """Batch sizes a co-batched step forward is padded up to: the warm-up's buckets on the compiled path,
        none (no padding) when every DiT runs eager."""
        return batch_buckets(self.od_config.max_num_seqs) if self.compiled else []

    @property
    def text_buckets(self) -> list[int]:
        """Text lengths a family pads its prompt tokens up to on the compiled path (under a key mask, so the
        result is unchanged): one CUDA graph per bucket instead of one per prompt length. None when eager."""
        return list(TEXT_BUCKETS) if self.compiled else []

    def warmup_text_lengths(self) -> list[int]:
        """Prompt lengths (tokens) the start-up warm-up runs, one per text bucket a default request can reach;
        [] = text length makes no signature (fixed-length encoders)."""
        return []

    def warmup_guided(self) -> bool:
        """Whether a negative prompt adds transformer rows (true CFG): the warm-up then runs each bucket guided
        too, so that the first request with a negative prompt does not compile while serving."""
        return False

    def advance(self, state: DenoiseState, ctx: StepContext, noise_pred: torch.Tensor) -> None:
        """The scheduler step of `state` with its guided prediction, then progress and any asked-for preview."""
        latents_before = state.latents
        state.latents = self.scheduler_step(state, noise_pred)
        state.step_index += 1
        ctx.report_progress(state.step_index, len(state.timesteps), state.request_ids)
        emit_previews(self.decode, state, ctx, latents_before, noise_pred)

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

    def cache_presets(self) -> FamilyPresets | None:
        """The family's quality presets for this pipeline's transformer, declared in the family's folder
        (`models/<family>/cache.py`, docs/cache.md); None = no cache hooks (`quality=high/fast` is a 400)."""
        return None

    @property
    def cache_transformers(self) -> dict[str, nn.Module]:
        """Every DiT a step may run, by the slot name `predict_noise` gives `call_transformer`."""
        return {name: getattr(self, name) for name in ("transformer", "transformer_2")
                if getattr(self, name, None) is not None}

    def cache_policy(self, request: OmniDiffusionRequest):
        """The request's cache policy on this stage (OmniClientError naming the field when it has none)."""
        return request_policy(self.od_config, self.cache_presets(), request.sampling_params)

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
        return self.guide(state, self.forward_step_inputs([self.cfg_step_inputs(state)], [state])[0])

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
        return self.transformer_rows(state)

    def step_inputs(self, state: DenoiseState) -> Any:
        """The transformer inputs of this state's latent rows at its own step (its timestep, its row of the step
        tables); fields declared `rows(text=True)` hold every transformer row (the prompts, then under CFG the
        negative prompts), as the conditioning keeps them."""
        raise NotImplementedError

    # ---- classifier-free guidance ----------------------------------------------------------------------------

    def step_cfg(self, state: DenoiseState) -> CFG | None:
        """The guidance of this state's step: its conditioning's, or None (no unconditional rows). A family whose
        guidance is off at some steps (HunyuanImage's guider) overrides it."""
        return state.conditioning.cfg

    def transformer_rows(self, state: DenoiseState) -> int:
        """Transformer rows of this state's step: its latent rows, plus their unconditional rows under CFG."""
        num_latent, cfg = state.latents.shape[0], self.step_cfg(state)
        return num_latent + (0 if cfg is None else cfg.num_uncond(num_latent))

    def cfg_step_inputs(self, state: DenoiseState) -> Any:
        """`step_inputs` with the unconditional rows: each per-latent-row field followed by its unconditional
        rows' entries; prompt fields cut to the latent rows at a step without CFG."""
        return with_uncond_rows(self.step_inputs(state), state.latents.shape[0], self.step_cfg(state))

    def guide(self, state: DenoiseState, pred: torch.Tensor) -> torch.Tensor:
        """This state's guided prediction from its raw prediction rows: each latent row with an unconditional
        row combined with it (`combine_cfg`), the others as they are."""
        cfg = self.step_cfg(state)
        if cfg is None:
            return pred
        num_latent = state.latents.shape[0]
        cond, uncond = pred[:num_latent], pred[num_latent:]
        if cfg.uncond is None:
            return self.combine_cfg(state, cond, uncond)
        return cond.index_copy(0, cfg.uncond, self.combine_cfg(state, cond.index_select(0, cfg.uncond), uncond))

    def cfg_scale(self, state: DenoiseState) -> float:
        """The guidance scale of this state's step: its conditioning's (a family with a scale per expert or per
        step overrides it)."""
        return state.conditioning.cfg.scale

    def combine_cfg(self, state: DenoiseState, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        """The guided prediction of conditional rows `cond` and their unconditional rows `uncond`: diffusers'
        `uncond + scale * (cond - uncond)`. A family overrides it only where its guidance differs."""
        return uncond + self.cfg_scale(state) * (cond - uncond)

    def forward_step_inputs(self, inputs: list[Any], states: list[DenoiseState]) -> list[torch.Tensor]:
        """ONE transformer forward over the rows of all `inputs` (their `rows()` fields concatenated, padded to
        the longest where declared); the raw prediction rows of each input, in order. One input under CFG
        parallel: this rank computes its branch's rows and the branches are gathered. `states` are the inputs'
        states, for their caches."""
        def call(slot: str, *args: Any, **kwargs: Any) -> Any:
            return call_transformer_rows(getattr(self, slot), states, slot, *args, **kwargs)

        if self.cpu_offloader is not None:
            self.cpu_offloader.offload_all()
        if len(inputs) == 1:
            num_positive, num_rows = states[0].latents.shape[0], step_rows(inputs[0])
            keep = cfg_branch_rows(num_positive, num_rows)
            branch = select_rows(inputs[0], keep)
            rows = step_rows(branch)
            extra = step_bucket(rows, self.step_buckets) - rows
            if extra and self.lora_manager is None and self.forward_group_key(states[0]) is not None:
                # Compiled path, a request batch: rows padded to the next captured bucket (the last row repeated,
                # its predictions dropped), as step mode pads its batches. Not while the state's cache works:
                # its residuals are per row; not with LoRA, which runs eager.
                branch = concat_rows([branch, *[select_rows(branch, slice(rows - 1, rows))] * extra])
            with self._lora_rows(inputs, states, keep):
                pred = self.transformer_forward(branch, call)[:rows]
            return [cfg_gather_rows(pred, num_positive, num_rows)]
        with self._lora_rows(inputs, states):
            pred = self.transformer_forward(concat_rows(inputs), call)
        return list(pred.split([step_rows(inp) for inp in inputs]))

    # ---- LoRA ----------------------------------------------------------------------------------------------

    @property
    def lora_manager(self) -> LoRAManager | None:
        """The adapters resident on this pipeline's DiTs (--enable-lora); None when LoRA is off."""
        if "_lora_manager" not in self.__dict__:
            manager = None
            if self.od_config.enable_lora and self.lora_loader is not None:
                import diffusers.loaders

                manager = LoRAManager(self.cache_transformers, getattr(diffusers.loaders, self.lora_loader),
                                      self.od_config.max_loras, self.od_config.max_lora_rank, self.device)
            self.__dict__["_lora_manager"] = manager
        return self.__dict__["_lora_manager"]

    def load_loras(self, requests: list[OmniDiffusionRequest]) -> None:
        """Makes the adapters of `requests` resident (OmniClientError naming `lora` for one that cannot be)."""
        for request in requests:
            refs = parse_lora(request.sampling_params.lora)
            if not refs:
                continue
            if self.lora_manager is None:
                why = "this server was started without --enable-lora" if self.lora_loader is not None else \
                    f"{type(self).__name__} takes no LoRA adapters"
                raise OmniClientError(f"lora: {why}", param="lora")
            resident = self.lora_manager.max_loras
            if len(refs) > resident:
                raise OmniClientError(f"lora lists {len(refs)} adapters; this server keeps {resident} resident "
                                      "(--max-loras)", param="lora")
            for ref in refs:
                self.lora_manager.load(ref)

    def request_adapters(self, request: OmniDiffusionRequest) -> tuple[LoRARef, ...]:
        """Every adapter `request`'s rows may run (what must fit `--max-loras` together): its `lora`."""
        return parse_lora(request.sampling_params.lora)

    def row_adapters(self, state: DenoiseState, request: OmniDiffusionRequest) -> tuple[LoRARef, ...]:
        """The adapters `request`'s rows run at `state`'s current step: its `lora` (LTX-2's refine pass adds its
        distilled adapter)."""
        return parse_lora(request.sampling_params.lora)

    def transformer_row_sources(self, state: DenoiseState) -> list[int]:
        """The latent row each of `state`'s transformer rows denoises: the latent rows, then (CFG) those with an
        unconditional row."""
        num_latent, cfg = state.latents.shape[0], self.step_cfg(state)
        sources = list(range(num_latent))
        if cfg is not None:
            sources += sources if cfg.uncond is None else cfg.uncond.tolist()
        return sources

    def _lora_rows(self, inputs: list[Any], states: list[DenoiseState], keep: slice | None = None
                   ) -> contextlib.AbstractContextManager[None]:
        """The adapters of every row of this forward (`keep`: the rows of the one input this rank computes)."""
        manager = self.lora_manager
        if manager is None:
            return contextlib.nullcontext()
        paths = {ref.path for state in states for r in state.requests for ref in self.row_adapters(state, r)}
        if len(paths) > manager.max_loras:  # before loading any: the states then step apart, evicting nothing here
            raise LoRACapacityError(f"this forward needs {len(paths)} adapters, {manager.max_loras} stay resident "
                                    "(--max-loras)")
        rows: list[RowAdapters] = []
        padded = states + [states[-1]] * (len(inputs) - len(states))  # compiled path: repeated inputs
        for state in padded:
            per_request = [tuple((manager.load(ref), ref.scale) for ref in self.row_adapters(state, r))
                           for r in state.requests]
            per = state.outputs_per_request
            rows += [per_request[src // per] for src in self.transformer_row_sources(state)]
        if keep is not None:
            rows = rows[keep]
        if not any(rows):
            return contextlib.nullcontext()
        return manager.forward_rows(rows)

    def transformer_forward(self, inp: Any, call: Callable[..., Any]) -> torch.Tensor:
        """The raw prediction rows of step input `inp` (one state's, one CFG branch's, or co-batched states'
        rows merged): `call(slot, *args, **kwargs)` runs the pipeline's transformer named `slot` through the
        cache; the family passes its fields in its transformer's signature."""
        raise NotImplementedError

    def scheduler_step(self, state: DenoiseState, noise_pred: torch.Tensor) -> torch.Tensor:
        t = state.timesteps[state.step_index]
        return state.scheduler.step(noise_pred, t, state.latents, return_dict=False)[0]

    def decode(self, state: DenoiseState) -> Any:
        """Final latents -> a sequence with one item per latent row (images, arrays, or latents)."""
        raise NotImplementedError


@dataclass(frozen=True)
class RowInput:
    """How a step input's field splits by transformer row."""

    dim: int = 0
    """The row axis."""
    pad: int | None = None
    """An axis zero-padded to the longest when states are concatenated (per-row text lengths)."""
    text: bool = False
    """One entry per transformer row, the unconditional rows' included (prompt embeddings: the negative prompts'
    rows follow); otherwise one per latent row, and CFG repeats the entries of the rows it guides."""
    shared: bool = False
    """One entry for all the state's rows (a step's table row): CFG leaves it, concatenation expands it."""


def rows(dim: int = 0, pad: int | None = None, *, text: bool = False, shared: bool = False) -> Any:
    """Declares a step-input dataclass field row-wise: a tensor with one entry per row along `dim` (one entry
    stands for every row, as in broadcasting), or a tuple with one item per row. None (an optional input that
    is absent) stays None. Fields not declared are the same for every row and taken from the first input."""
    return field(metadata={"rows": RowInput(dim, pad, text, shared)})


def _row_fields(inp: Any) -> list[tuple[str, RowInput]]:
    return [(f.name, f.metadata["rows"]) for f in dataclasses.fields(inp) if "rows" in f.metadata]


def step_rows(inp: Any) -> int:
    """The transformer rows of step input `inp`: the length of its first row-wise field."""
    name, spec = _row_fields(inp)[0]
    value = getattr(inp, name)
    return len(value) if isinstance(value, tuple) else value.shape[spec.dim]


def with_uncond_rows(inp: Any, num_latent: int, cfg: CFG | None) -> Any:
    """Step input `inp` of `num_latent` latent rows, in place, with the unconditional rows of `cfg` appended:
    per-latent-row fields repeat the guided rows' entries; prompt fields (`text`) already hold them, and are cut
    to the latent rows when `cfg` is None (a step without CFG)."""
    for name, spec in _row_fields(inp):
        value = getattr(inp, name)
        if value is None or spec.shared:
            continue
        if spec.text:
            if cfg is None:
                setattr(inp, name, value[:num_latent] if isinstance(value, tuple)
                        else value.narrow(spec.dim, 0, num_latent))
        elif cfg is not None and isinstance(value, tuple):
            setattr(inp, name, value + (value if cfg.uncond is None else tuple(value[i] for i in cfg.uncond.tolist())))
        elif cfg is not None and value.shape[spec.dim] == num_latent:  # else one entry standing for every row
            uncond = value if cfg.uncond is None else value.index_select(spec.dim, cfg.uncond)
            setattr(inp, name, torch.cat([value, uncond], dim=spec.dim))
    return inp


def select_rows(inp: Any, keep: slice) -> Any:
    """`inp` with only the rows `keep` (a broadcast field stays whole)."""
    changes = {}
    for name, spec in _row_fields(inp):
        value = getattr(inp, name)
        if isinstance(value, tuple):
            changes[name] = value[keep]
        elif value is not None and value.shape[spec.dim] != 1:
            changes[name] = value[(slice(None),) * spec.dim + (keep,)]
    return dataclasses.replace(inp, **changes)


def concat_rows(inputs: list[Any]) -> Any:
    """One step input holding the rows of all `inputs` in order (each broadcast field expanded to its rows)."""
    counts = [step_rows(inp) for inp in inputs]
    changes: dict[str, Any] = {}
    for name, spec in _row_fields(inputs[0]):
        values = [getattr(inp, name) for inp in inputs]
        if values[0] is None:
            changes[name] = None
        elif isinstance(values[0], tuple):
            changes[name] = sum(values, ())
        else:
            if spec.pad is not None:
                longest = max(v.shape[spec.pad] for v in values)
                values = [F.pad(v, (0, 0) * (v.dim() - 1 - spec.pad) + (0, longest - v.shape[spec.pad]))
                          for v in values]
            values = [v.expand(*v.shape[:spec.dim], n, *v.shape[spec.dim + 1:]) if v.shape[spec.dim] != n else v
                      for v, n in zip(values, counts, strict=True)]
            changes[name] = torch.cat(values, dim=spec.dim)
    return dataclasses.replace(inputs[0], **changes)


def prompt_rows(requests: list[OmniDiffusionRequest], cfg: CFG | None, default: str = ""
                ) -> list[tuple[str, int]]:
    """(text, request index) of a group's prompt rows in the order its per-prompt fields hold them: every
    request's prompt, then under CFG every request's negative prompt (`default` where it has none)."""
    rows = [(r.prompt_text, i) for i, r in enumerate(requests)]
    if cfg is not None:
        rows += [(default if r.negative_prompt is None else r.negative_prompt, i) for i, r in enumerate(requests)]
    return rows


def pad_text(embeds: torch.Tensor, lengths: tuple[int, ...], buckets: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeds zero-padded along dim 1 to the next of `buckets`, the (rows, bucket) bool mask of each row's
    `lengths` real tokens), both on the embeddings' device: inputs of one CUDA graph per bucket."""
    seq = step_bucket(embeds.shape[1], buckets)
    embeds = F.pad(embeds, (0, 0, 0, seq - embeds.shape[1]))
    mask = torch.arange(seq, device=embeds.device) < torch.tensor(lengths, device=embeds.device)[:, None]
    return embeds, mask


def _enter_step(state: DenoiseState, ctx: StepContext) -> None:
    ctx.step_index, ctx.timestep = state.step_index, state.normalized_timesteps[state.step_index]


def _attempt(fn: Callable[[], object]) -> Exception | None:
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def refuse_pipeline_kwargs(requests: list[OmniDiffusionRequest]) -> None:
    """`extra_args` (e.g. {"sigmas": [...]}) are diffusers `__call__` arguments that only the generic diffusers
    adapter passes on; a native pipeline refuses them rather than run without them."""
    for request in requests:
        if request.sampling_params.extra_args:
            raise OmniClientError(f"extra_args={request.sampling_params.extra_args!r} is not supported by "
                                  "vllm-omni's native pipelines (the generic diffusers adapter passes it to the "
                                  "diffusers pipeline)", param="extra_args")


def _aborted_output() -> DiffusionOutput:
    return DiffusionOutput.from_exception(RequestAbortedError())
