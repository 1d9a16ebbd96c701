"""Diffusion runtime config and result types shared by the engine, the workers and the pipelines."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from vllm_omni import envs
from vllm_omni.errors import OmniClientError, OmniError, RequestAbortedError
from vllm_omni.inputs.data import MAX_DEADLINE_MS
from vllm_omni.outputs import CompileStats, StepStats

if TYPE_CHECKING:
    from vllm.config.logging import LoggingConfig

DIFFUSION_LOAD_FORMATS = ("auto", "dummy")
"""Weight sources of a diffusion stage (a subset of vLLM's `--load-format`)."""


NOT_IMPLEMENTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "num_gpus": ("placement by --num-gpus (use --tensor-parallel-size and the deploy config's devices)", (1,)),
}
"""Knobs the schema reserves for features that are not built yet: feature name and the values that mean "off".

Any other value is refused where the config is resolved, so a knob is never accepted and silently ignored."""


def refuse_unimplemented(values: dict[str, Any]) -> None:
    """Raise `OmniClientError` naming the knob (and its CLI flag) for any unimplemented knob that is set."""
    for name, value in values.items():
        if name not in NOT_IMPLEMENTED or value is None:
            continue
        feature, off = NOT_IMPLEMENTED[name]
        if value not in off:
            flag = "--" + name.replace("_", "-")
            raise OmniClientError(f"{name}={value!r} ({flag}): {feature} is not implemented yet; leave it unset",
                                  param=name)


def check_attention_backend(name: str | None,
                            source: str = "diffusion_attention_backend (--diffusion-attention-backend)") -> None:
    """Fail where the config is resolved, not in a worker that is loading weights."""
    if name is None:
        return
    from vllm_omni.diffusion.attention.selector import available_backends

    if name.upper() not in available_backends():
        raise OmniClientError(f"{source}={name!r} is not a diffusion attention backend; choose one of "
                              f"{available_backends()}", param="diffusion_attention_backend")


def check_cache_args(values: dict[str, Any]) -> None:
    """The server's cache backend and default cache config (OmniClientError naming the field)."""
    from vllm_omni.diffusion.cache.policy import CacheDefaults

    defaults = CacheDefaults(values.get("cache_backend") or "none", values.get("cache_config") or {})
    if defaults.backend == "cache_dit" and values.get("step_execution"):
        raise OmniClientError("cache_backend='cache_dit' (--cache-backend) keeps its cache context on the "
                              "transformer, shared by every resident request, so it cannot run with "
                              "--step-execution; use --cache-backend tea_cache (per-request state)",
                              param="cache_backend")


def _parallel_args(engine_args: dict[str, Any]) -> dict[str, Any]:
    parallel = engine_args.get("parallel_config")  # a DiffusionParallelConfig object checked itself
    return {**{k: v for k, v in engine_args.items() if k in _PARALLEL_FIELDS and v is not None},
            **(parallel if isinstance(parallel, dict) else {})}


def check_diffusion_args(engine_args: dict[str, Any]) -> None:
    """The checks of `OmniDiffusionConfig` that need no engine process, run when the stage is resolved."""
    parallel = _parallel_args(engine_args)
    refuse_unimplemented({**engine_args, **parallel})
    DiffusionParallelConfig(**parallel)
    check_torch_num_threads(engine_args.get("torch_num_threads"))
    check_cache_args(engine_args)
    if engine_args.get("diffusion_attention_backend") is not None:
        check_attention_backend(engine_args["diffusion_attention_backend"])
    else:  # the env var is only the fallback of an unset flag
        check_attention_backend(envs.DIFFUSION_ATTENTION_BACKEND, "env DIFFUSION_ATTENTION_BACKEND")


def check_torch_num_threads(value: Any) -> None:
    """`torch_num_threads` (a diffusion or generation stage's) is None or a positive integer."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise OmniClientError(f"torch_num_threads={value!r} (--torch-num-threads) must be a positive integer",
                              param="torch_num_threads")


def diffusion_world_size(engine_args: dict[str, Any]) -> int:
    """The worker processes of one engine of a stage with these (checked) arguments."""
    parallel = engine_args.get("parallel_config")
    if not isinstance(parallel, DiffusionParallelConfig):
        parallel = DiffusionParallelConfig(**_parallel_args(engine_args))
    return parallel.world_size


def resolve_device_kind(device: str | None) -> str:
    """The device type a stage's workers run on: `device`, else cuda when available, else cpu."""
    if device is not None:
        return device.split(":")[0]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_warmup_shapes(text: str | None) -> list[tuple[int, int]] | None:
    """`"512x512,1024x768"` -> [(512, 512), (1024, 768)] as (width, height); None stays None (the model's
    default size). OmniClientError naming the field when an entry is not WxH with positive sizes."""
    if text is None:
        return None
    shapes = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        width, sep, height = entry.lower().partition("x")
        if not (sep and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
            raise OmniClientError(f"diffusion_warmup_shapes={text!r} (--diffusion-warmup-shapes): {entry!r} is not "
                                  "WxH (e.g. 1024x1024)", param="diffusion_warmup_shapes")
        shapes.append((int(width), int(height)))
    return shapes


@dataclass
class DiffusionParallelConfig:
    """How one diffusion stage splits its work over devices: world = TP x Ulysses x ring x CFG ranks (or the
    VAE patch degree when it is larger), one worker process per rank (see docs/parallelism.md)."""

    tensor_parallel_size: int = 1
    """Shards every transformer layer over this many devices (one worker process per rank)."""
    sequence_parallel_size: int | None = None
    """Ranks that each hold a slice of the image/video tokens: ulysses_degree x ring_degree x allgather_degree.
    None = that product; set alone it is the Ulysses degree."""
    ulysses_degree: int = 1
    """Ulysses sequence parallelism: all-to-all that trades a sequence shard for a head shard around each
    attention; must divide the attention heads left after tensor parallelism."""
    ring_degree: int = 1
    """Ring-attention sequence parallelism: K/V blocks passed around the ring, partial results merged by
    log-sum-exp; no head constraint, more communication than Ulysses."""
    allgather_degree: int = 1
    """AllGather-KV sequence parallelism: every rank all-gathers the K/V shards (the K/V heads only, so GQA
    stays compressed) and attends its own queries over the whole sequence: no head constraint and one
    all-gather per attention, but the whole sequence's K/V on every rank. Not combined with ring_degree."""
    ulysses_mode: Literal["strict", "advanced_uaa"] = "strict"
    """strict: ulysses_degree must divide the attention heads. advanced_uaa: the heads are zero-padded up to a
    multiple of it for the all-to-all and the padding dropped after the attention (K/V head padding is not
    supported with ring_degree > 1)."""
    cfg_parallel_size: int = 1
    """2 = the positive and the negative (true CFG) branch run on different ranks, joined by an all-gather."""
    vae_patch_parallel_size: int = 1
    """Ranks that split the VAE decode into row strips (each with a halo covering the decoder's receptive field,
    gathered into the whole image/video). Reuses the TP/SP/CFG ranks (decode runs after the denoise loop): it
    must divide their product or be a multiple of it (then the denoise loop runs on every group of ranks)."""
    data_parallel_size: int = 1
    """Replicas of the diffusion stage, each a full engine (all its ranks) on its own devices; requests go to
    the least loaded live replica. Resolved into the stage's `num_replicas` (the deploy config's name for it),
    so an engine itself always has 1."""
    distributed_timeout_seconds: int = 600
    """Seconds any collective between the stage's ranks may wait (vLLM's flag; here it also bounds the CPU
    groups): a rank whose peer failed or hung mid-forward gives up after this, and the stage restarts its
    workers (see docs/parallelism.md, "When one rank fails")."""

    def __post_init__(self) -> None:
        refuse_unimplemented(asdict(self))
        timeout = self.distributed_timeout_seconds
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 1:
            raise OmniClientError(f"distributed_timeout_seconds={timeout!r} (--distributed-timeout-seconds) must "
                                  "be a positive integer", param="distributed_timeout_seconds")
        for name in ("tensor_parallel_size", "ulysses_degree", "ring_degree", "allgather_degree",
                     "cfg_parallel_size", "vae_patch_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OmniClientError(f"{name}={value!r} ({_flag(name)}) must be a positive integer", param=name)
        if self.cfg_parallel_size > 2:
            raise OmniClientError(f"cfg_parallel_size={self.cfg_parallel_size} (--cfg-parallel-size) must be 1 or "
                                  "2 (one rank per CFG branch)", param="cfg_parallel_size")
        if self.ulysses_mode not in ("strict", "advanced_uaa"):
            raise OmniClientError(f"ulysses_mode={self.ulysses_mode!r} (--ulysses-mode) must be 'strict' or "
                                  "'advanced_uaa'", param="ulysses_mode")
        if self.ring_degree > 1 and self.allgather_degree > 1:
            raise OmniClientError(f"allgather_degree={self.allgather_degree} (--allgather-degree) cannot be combined "
                                  f"with ring_degree={self.ring_degree} (--ring-degree): both pass the K/V of the "
                                  "other sequence shards; choose one", param="allgather_degree")
        product = self.ulysses_degree * self.ring_degree * self.allgather_degree
        if self.sequence_parallel_size is None:
            self.sequence_parallel_size = product
        elif product == 1 and self.sequence_parallel_size > 1:
            self.ulysses_degree = self.sequence_parallel_size
        elif self.sequence_parallel_size != product:
            raise OmniClientError(
                f"sequence_parallel_size={self.sequence_parallel_size} (--sequence-parallel-size) must equal "
                f"ulysses_degree x ring_degree x allgather_degree = {product}", param="sequence_parallel_size")
        denoise, vae = self.denoise_world_size, self.vae_patch_parallel_size
        if denoise % vae and vae % denoise:
            raise OmniClientError(
                f"vae_patch_parallel_size={vae} (--vae-patch-parallel-size) must divide or be a multiple of "
                f"tensor_parallel_size x sequence_parallel_size x cfg_parallel_size = {denoise}",
                param="vae_patch_parallel_size")

    @property
    def denoise_world_size(self) -> int:
        """Ranks of one copy of the denoise loop: TP x SP x CFG."""
        return self.tensor_parallel_size * self.sequence_parallel_size * self.cfg_parallel_size

    @property
    def world_size(self) -> int:
        return max(self.denoise_world_size, self.vae_patch_parallel_size) * self.data_parallel_size


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_PARALLEL_FIELDS = frozenset(f.name for f in fields(DiffusionParallelConfig))


@dataclass
class RayPlacement:
    """Where a stage's ranks run when its workers are Ray actors (the deploy config's `worker_backend: ray`)."""

    address: str | None = None
    """The cluster `ray.init` joins; None = $RAY_ADDRESS, else a cluster started on this host."""
    resources: dict[str, float] = field(default_factory=dict)
    """Ray resources of each rank's placement-group bundle beyond its device."""
    strategy: str = "STRICT_PACK"
    """Placement-group strategy: STRICT_PACK keeps the ranks (and their collectives) on one node."""


@dataclass
class OmniDiffusionConfig:
    """Everything a diffusion stage needs, materialized inside the process that owns the engine.

    Built by `from_kwargs` from the resolved stage config or from `Omni(model=..., **kwargs)`.
    """

    model: str
    model_class_name: str | None = None
    """Diffusion pipeline class instead of `_class_name` of model_index.json (e.g. `WanImageToVideoPipeline`
    for Wan2.2-TI2V-5B image-to-video, or a `module:Class` path)."""
    dtype: str = "auto"
    """auto = bfloat16 on CUDA, float32 on CPU; or float32 / bfloat16 / float16."""
    device: str | None = None
    """None = cuda when available, else cpu."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of the checkpoint."""
    torch_num_threads: int | None = None
    """Torch intra-op threads of each process of this stage that computes beside vLLM's CPU workers (each
    diffusion rank; the engine process, which runs the generation stages such as a speech decoder). None: the
    host's CPUs that the pipeline's vLLM CPU workers leave free (their VLLM_CPU_OMP_THREADS_BIND CPUs, or under
    `auto` all but VLLM_CPU_NUM_OF_RESERVED_CPU) divided among those processes, at least 1, so that processes x
    threads does not exceed the cores."""
    parallel_config: DiffusionParallelConfig = field(default_factory=DiffusionParallelConfig)
    diffusion_attention_backend: str | None = None
    """Attention backend of the transformer's layers; None = env DIFFUSION_ATTENTION_BACKEND, then the
    fastest one installed for the device (see docs/attention_backends.md)."""
    max_num_seqs: int = 1
    """Most requests co-batched into one forward (request mode), or resident and stepping (step mode)."""
    request_batch_max_wait_ms: float = 0.0
    """Request mode: milliseconds the scheduler waits for compatible requests to fill a batch (refused in step
    mode, where a request joins at the next step boundary)."""
    step_execution: bool = False
    """Admit and retire requests at every denoise-step boundary (up to max_num_seqs resident; compatible
    resident states share one transformer forward per step): a new request starts at the next step instead of
    behind a whole request, and an abort or a failure inside a step ends only its own request. Pipelines that
    cannot step (the diffusers adapter) serve in request mode (with a warning). With TP / sequence / CFG ranks
    the engine's scheduler decides admission, preemption, retirement and aborts, and every rank executes the
    same plan each step."""
    diffusion_max_tokens_per_forward: int | None = 16384
    """Step mode: most tokens (transformer rows incl. CFG x image + text tokens) in one co-batched forward;
    a larger group of compatible states is split into several forwards, a state larger than the cap runs
    alone. The default co-batches small sizes, where batching pays, and not 1024^2 CFG states (a forward
    there is compute-bound; co-batching would only add activation memory). 1 = one forward per state (the
    request-mode arithmetic exactly); None = no cap beyond max_num_seqs."""
    diffusion_scheduler_policy: Literal["fcfs", "priority", "slo"] = "fcfs"
    """Which waiting requests run first. fcfs: arrival order. priority: vLLM's priority scheduling (lower
    `priority` first, then arrival). slo: earliest deadline first (`deadline_ms`, else --default-deadline-ms),
    requests that can no longer make theirs last (until --slo-starvation-factor). In step mode
    priority and slo also pick which resident states take the step slots: a more urgent arrival pauses a less
    urgent state at a step boundary (it keeps its latents and resumes later). In request mode they order the
    queue of whole requests."""
    default_deadline_ms: float = 60000.0
    """Deadline of a request that sets no `deadline_ms` (slo policy), in milliseconds after its arrival."""
    slo_deadline_factor: float = 2.0
    """slo policy (both modes): a request that sets no `deadline_ms` gets arrival + this x its solo time as the
    cost model estimates it (measured seconds per step of its shape x its steps, plus encode and decode), so a
    short request overtakes a long one by default; `default_deadline_ms` until its shape (or a solo step of another
    shape, scaled by pixels) was measured. 0 = always `default_deadline_ms`."""
    slo_starvation_factor: float = 4.0
    """slo policy (both modes): a request that can no longer make its deadline waits behind the ones that can only
    until it is late by this x its deadline window (deadline - arrival); then it runs before them, so under
    sustained load it is not starved. Lower = shorter worst-case wait (p95/p99), fewer deadlines met; inf = no
    bound. The default is from benchmarks/diffusion/sim_step_policies.py (docs/execution_modes.md)."""
    slo_admission_control: bool = False
    """slo policy (both modes): refuse at arrival, with HTTP 429 naming `deadline_ms` and the predicted finish, a
    request that the cost model predicts cannot finish by its deadline behind the queued requests with earlier
    deadlines, within the floor --slo-admission-min-accept. Off: every request is admitted."""
    slo_admission_min_accept: float = 0.9
    """--slo-admission-control's throughput floor, in (0, 1]: the least share of the last 100 arrivals admitted;
    a request whose refusal would go below it is admitted and served late instead."""
    max_paused_states: int = 4
    """Step mode: most states the workers keep paused by preemption (each holds its latents and prompt embeddings);
    when that many are paused, an urgent request waits for a free step slot instead of pausing one more."""
    cache_backend: Literal["cache_dit", "tea_cache", "none"] | None = None
    """Cache acceleration of the native DiTs (docs/cache.md): tea_cache (ours, per-request state, any mode) or
    cache_dit (the cache-dit library, request mode only). It serves requests naming no quality with
    --cache-config, and the high / fast presets; quality=lossless always runs uncached. None/none: requests
    naming no quality run uncached, high / fast ones use tea_cache."""
    cache_config: dict[str, Any] = field(default_factory=dict)
    """The default cache settings of requests that name no quality: {"quality": "high" | "fast"} picks the
    family preset it starts from ({} = high), other keys override it (e.g. {"rel_l1_thresh": 0.2} for
    adaptive TeaCache, {"Fn_compute_blocks": 1, "residual_diff_threshold": 0.12} for cache-dit)."""
    enforce_eager: bool | None = None
    """Eager transformer. None (default) resolves by the stage's device as vLLM does: False on CUDA (compiled
    blocks + CUDA graphs where the pipeline supports them, warmed up at start-up), True on CPU (nothing there
    compiles). An explicit False on CPU also runs eager."""
    diffusion_warmup_shapes: str | None = None
    """Compiled path: comma-separated WxH sizes (e.g. "512x512,1024x1024") that start-up compiles and captures at
    every batch bucket the stage can form (powers of two up to --max-num-seqs), before the server says ready;
    None = the model's default size; "" = no warm-up (the first request of each shape compiles)."""
    diffusion_compile_cache_dir: str | None = None
    """Compiled path: where torch.compile keeps its Inductor / FX graph caches, so a restart loads the compiled
    blocks instead of compiling them; None = $VLLM_CACHE_ROOT/torch_compile_cache/diffusion."""
    fa_deterministic: bool = False
    """Deterministic FlashAttention on the dense diffusion path (slower; for accuracy CI)."""
    num_gpus: int = 1
    """Not implemented yet (devices come from --tensor-parallel-size and the deploy config): refused unless 1."""
    init_timeout: float = 600.0
    """Seconds the engine waits for every worker to load the model; a worker that fails to load fails start-up
    with its rank and traceback."""
    max_stage_restarts: int = 3
    """How many times the engine replaces workers that died (crash, OOM kill) before the stage is dead; the
    requests a dying worker ran fail with 503, queued ones wait for the new workers."""
    diffusion_memory_budget_gb: float | None = None
    """GiB of memory the diffusion stage's requests may use together beyond the weights (admission by each
    request's estimated latents, activations and step tables at its shape): a request that could never fit is a
    400 naming the field that makes it too big, one that fits later waits for running requests to finish.
    None = on CUDA the free device memory measured after the model loaded, on CPU no memory admission."""
    enable_lora: bool = False
    """Serve per-request LoRA adapters (the `lora` request field, docs/lora.md): deltas beside the native DiT's
    linears, never merged, so requests with different adapters share a forward. Runs the transformer eager
    (an adapter mix per forward is data, not a shape a compiled graph could fix)."""
    max_loras: int = 1
    """Adapters resident on the device at once (LRU); a forward never runs more than this many."""
    max_lora_rank: int = 16
    """Highest LoRA rank accepted; a file above it is refused (400 naming `lora`)."""
    diffusers_load_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of diffusers' `from_pretrained` on the generic adapter path."""
    use_diffusers_adapter: bool = False
    """Force the generic diffusers adapter even when a native pipeline exists."""
    enable_progress_bar: bool = False
    """A tqdm bar over the denoise steps in the worker's log."""
    stage_id: int = 0
    """The stage this engine serves; set at resolution, it names the worker processes in log lines."""
    logging_config: LoggingConfig | None = None
    """vLLM logging config of the server (`--log-level`, `--logging-config`) applied in every worker process;
    None = vLLM's defaults from the environment."""
    ray: RayPlacement | None = None
    """Set from the deploy config when the stage's ranks are Ray actors; None = worker processes of this host."""
    load_format: str = "auto"
    """auto = the checkpoint's weights; dummy = only its configs and tokenizers are read, every component is
    built from its config with small random weights (benchmarks of real model sizes without weight files)."""

    enable_layerwise_offload: bool = False
    """Keep the DiT's repeated blocks in (pinned) host memory and copy each in on a side stream while the block
    before it computes (docs/memory.md): the transformer needs the device memory of its non-block layers plus a
    few blocks. Runs the transformer eager (the blocks' weights move every step: no CUDA graph can hold them)."""
    offload_resident_layers: int = 0
    """Layerwise offload: how many of the first blocks stay on the device (each one fewer copied per step)."""
    offload_prefetch_layers: int = 1
    """Layerwise offload: how many blocks ahead a block's copy is issued (1 or 2; 2 absorbs uneven blocks at
    the cost of one more block's memory)."""
    enable_cpu_offload: bool = False
    """Keep the text encoder(s) and the VAE in host memory and move each to the device only while it runs (as
    diffusers' enable_model_cpu_offload): frees their memory for the denoise loop, costs a copy per request."""
    quantization: Literal["fp8"] | None = None
    """Online quantization of the DiT (vLLM's flag): fp8 = FP8 weights with per-channel scales and per-token dynamic
    activation scales, GEMMs through torch._scaled_mm (docs/memory.md); embeddings, adaLN modulation, norms and
    the final projection stay in the stage dtype. Needs compute capability >= 8.9 on CUDA."""
    quantization_config: dict[str, Any] = field(default_factory=dict)
    """With --quantization fp8: {"ignore": [fnmatch patterns of module names]} (vLLM's key) replaces the default
    list of layers kept in the stage dtype."""
    enable_distributed_layerwise_offload: bool = False
    """DLO: the stage's --data-parallel-size ranks form one engine in which each rank keeps 1/N of every DiT block
    and reassembles a block just before it runs; each rank runs its own request, in waves of compatible requests
    (docs/memory.md). A model that fits only across N devices serves N requests at a time."""
    dlo_use_allgather: bool = True
    """DLO: each rank keeps a 1/N shard of every block, all-gathered before it runs; False: each block is kept
    whole by one rank (block i by rank i mod N) and broadcast from it."""
    dlo_resident_layers: int = 0
    """DLO: how many of the first blocks stay whole on every rank (no collective for them)."""

    def __post_init__(self) -> None:
        refuse_unimplemented({f.name: getattr(self, f.name) for f in fields(self)})
        check_torch_num_threads(self.torch_num_threads)
        self._check_quantization()
        self._check_offload()
        if self.enable_lora and self.enforce_eager is False:
            raise ValueError("enable_lora runs the transformer eager: drop enforce_eager=False")
        if self.enforce_eager is None:
            self.enforce_eager = self.enable_lora or resolve_device_kind(self.device) != "cuda"
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, "
                             f"{self.max_lora_rank}")
        parse_warmup_shapes(self.diffusion_warmup_shapes)
        check_cache_args({"cache_backend": self.cache_backend, "cache_config": self.cache_config,
                          "step_execution": self.step_execution})
        check_attention_backend(self.diffusion_attention_backend)
        if self.diffusion_max_tokens_per_forward is not None and self.diffusion_max_tokens_per_forward < 1:
            raise ValueError("diffusion_max_tokens_per_forward must be >= 1 (1 = one forward per state), got "
                             f"{self.diffusion_max_tokens_per_forward}")
        if self.diffusion_memory_budget_gb is not None and not self.diffusion_memory_budget_gb > 0:
            raise ValueError(f"diffusion_memory_budget_gb must be > 0, got {self.diffusion_memory_budget_gb}")
        if not 0 < self.default_deadline_ms <= MAX_DEADLINE_MS:
            raise ValueError(f"default_deadline_ms must be in (0, {MAX_DEADLINE_MS:.0f}], got "
                             f"{self.default_deadline_ms}")
        if not 0 <= self.slo_deadline_factor < math.inf:
            raise ValueError(f"slo_deadline_factor must be >= 0 and finite, got {self.slo_deadline_factor}")
        if not self.slo_starvation_factor >= 0:
            raise ValueError(f"slo_starvation_factor must be >= 0, got {self.slo_starvation_factor}")
        if self.slo_admission_control and self.diffusion_scheduler_policy != "slo":
            raise ValueError("slo_admission_control (--slo-admission-control) needs diffusion_scheduler_policy "
                             f"'slo', got {self.diffusion_scheduler_policy!r}")
        if not 0 < self.slo_admission_min_accept <= 1:
            raise ValueError(f"slo_admission_min_accept must be in (0, 1], got {self.slo_admission_min_accept}")
        if self.slo_admission_min_accept != 0.9 and not self.slo_admission_control:
            raise ValueError("slo_admission_min_accept (--slo-admission-min-accept) applies only with "
                             "slo_admission_control (--slo-admission-control)")
        if self.max_paused_states < 0:
            raise ValueError(f"max_paused_states must be >= 0, got {self.max_paused_states}")
        if self.max_stage_restarts < 0:
            raise ValueError(f"max_stage_restarts must be >= 0, got {self.max_stage_restarts}")
        if self.load_format not in DIFFUSION_LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(DIFFUSION_LOAD_FORMATS)}, got {self.load_format!r}")

    def _check_quantization(self) -> None:
        if self.quantization not in (None, "fp8"):
            raise OmniClientError(f"quantization={self.quantization!r} (--quantization): diffusion stages take only "
                                  "'fp8' (online FP8)", param="quantization")
        config = self.quantization_config
        if not isinstance(config, dict):  # vLLM's CLI parses --quantization-config into QuantizationConfigArgs
            extra = [name for name in ("linear", "moe", "targets") if getattr(config, name, None)]
            config = {"ignore": list(config.ignore), **dict.fromkeys(extra, True)}
        self.quantization_config = {key: value for key, value in config.items() if value or key != "ignore"}
        unknown = sorted(set(self.quantization_config) - {"ignore"})
        if unknown or (self.quantization_config and self.quantization is None):
            why = f"unknown key(s) {unknown}" if unknown else "set without --quantization fp8"
            raise OmniClientError(f"quantization_config (--quantization-config): {why}; diffusion stages take "
                                  '{"ignore": [fnmatch patterns of module names]}', param="quantization_config")

    def _check_offload(self) -> None:
        if self.offload_resident_layers < 0:
            raise OmniClientError(f"offload_resident_layers={self.offload_resident_layers} "
                                  "(--offload-resident-layers) must be >= 0", param="offload_resident_layers")
        if self.offload_prefetch_layers not in (1, 2):
            raise OmniClientError(f"offload_prefetch_layers={self.offload_prefetch_layers} "
                                  "(--offload-prefetch-layers) must be 1 or 2", param="offload_prefetch_layers")
        if self.enable_distributed_layerwise_offload:
            self._check_dlo()
        elif not self.enable_layerwise_offload:
            return
        if self.enforce_eager is False:
            name = ("enable_layerwise_offload" if self.enable_layerwise_offload
                    else "enable_distributed_layerwise_offload")
            raise OmniClientError(f"{name} ({_flag(name)}) runs the transformer eager: its blocks' weights are "
                                  "swapped in every step, so neither a CUDA graph nor the fullgraph-compiled blocks "
                                  "can hold them; drop --no-enforce-eager", param=name)
        self.enforce_eager = True

    def _check_dlo(self) -> None:
        """DLO's ranks must all run the same blocks in the same order, whatever their requests."""
        name = "enable_distributed_layerwise_offload"
        parallel = self.parallel_config
        why = None
        if parallel.data_parallel_size < 2:
            why = "needs --data-parallel-size >= 2 (the ranks that share the blocks)"
        elif parallel.denoise_world_size > 1 or parallel.vae_patch_parallel_size > 1:
            why = "is not combined with tensor / sequence / CFG / VAE patch parallelism"
        elif self.enable_layerwise_offload:
            why = "replaces --enable-layerwise-offload (choose one)"
        elif self.step_execution:
            why = "runs whole requests in waves, not --step-execution"
        elif self.cache_backend not in (None, "none"):
            why = f"cannot run --cache-backend {self.cache_backend}: each rank would skip different blocks"
        elif self.max_num_seqs != 1:
            why = "runs one request per rank (a wave is --data-parallel-size requests); leave --max-num-seqs 1"
        elif self.dlo_resident_layers < 0:
            name, why = "dlo_resident_layers", "must be >= 0"
        if why is not None:
            raise OmniClientError(f"{name} ({_flag(name)}) {why}", param=name)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> OmniDiffusionConfig:
        """Build from flat engine kwargs; unknown keys are an error (every knob is a typed field)."""
        names = {f.name for f in fields(cls)}
        parallel_names = {f.name for f in fields(DiffusionParallelConfig)}
        parallel = {k: kwargs.pop(k) for k in list(kwargs) if k in parallel_names}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown diffusion engine argument(s): {unknown}")
        if "parallel_config" not in kwargs:
            kwargs["parallel_config"] = DiffusionParallelConfig(**parallel)
        elif isinstance(kwargs["parallel_config"], dict):
            kwargs["parallel_config"] = DiffusionParallelConfig(**kwargs["parallel_config"])
        if isinstance(kwargs.get("ray"), dict):
            kwargs["ray"] = RayPlacement(**kwargs["ray"])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DiffusionOutput:
    """One request's result from a pipeline (or its error, when it failed alone)."""

    output: Any = None
    """PIL images / uint8 frames / np arrays, per pipeline."""
    error: str | None = None
    error_status_code: int | None = None
    error_type: str | None = None
    error_param: str | None = None
    """The request field a client error names (e.g. `lora`), for the HTTP body's `param`."""
    stage_durations: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    step_stats: StepStats | None = None
    """Step mode only."""
    compile_stats: CompileStats | None = None
    """The compiled path only: the worker's counts when this output left it."""

    @classmethod
    def from_exception(cls, exc: BaseException) -> DiffusionOutput:
        if isinstance(exc, OmniClientError):
            return cls(error=exc.message, error_status_code=exc.status_code, error_type=exc.error_type,
                       error_param=exc.param)
        if isinstance(exc, RequestAbortedError):
            return cls(error=str(exc), error_status_code=exc.status_code, error_type=exc.error_type)
        status = exc.status_code if isinstance(exc, OmniError) else 500
        return cls(error=f"{type(exc).__name__}: {exc}", error_status_code=status, error_type=type(exc).__name__)
