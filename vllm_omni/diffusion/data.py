"""Diffusion runtime config and result types shared by the engine, the workers and the pipelines."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from vllm_omni.errors import OmniClientError, OmniError

DIFFUSION_LOAD_FORMATS = ("auto", "dummy")
"""Weight sources of a diffusion stage (a subset of vLLM's `--load-format`)."""


@dataclass
class DiffusionParallelConfig:
    tensor_parallel_size: int = 1
    sequence_parallel_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        tp, sp = self.tensor_parallel_size, self.sequence_parallel_size
        return tp * sp * self.cfg_parallel_size * self.data_parallel_size


@dataclass
class OmniDiffusionConfig:
    """Everything a diffusion stage needs, materialized inside the process that owns the engine.

    Built by `from_kwargs` from the resolved stage config or from `Omni(model=..., **kwargs)`.
    """

    model: str
    model_class_name: str | None = None
    """Pipeline class; None = read `_class_name` from model_index.json."""
    dtype: str = "auto"
    """auto = bfloat16 on CUDA, float32 on CPU."""
    device: str | None = None
    """None = cuda when available, else cpu."""
    revision: str | None = None
    parallel_config: DiffusionParallelConfig = field(default_factory=DiffusionParallelConfig)
    diffusion_attention_backend: str | None = None
    """TORCH_SDPA | CUDNN_ATTN | FLASH_ATTN | FLASHINFER_ATTN; None = env DIFFUSION_ATTENTION_BACKEND or auto."""
    max_num_seqs: int = 1
    """Most requests co-batched into one forward (request-batch mode)."""
    request_batch_max_wait_ms: float = 0.0
    """How long the scheduler waits for compatible requests to fill a batch."""
    cache_backend: Literal["cache_dit", "none"] | None = None
    cache_config: dict[str, Any] = field(default_factory=dict)
    enforce_eager: bool = True
    fa_deterministic: bool = False
    num_gpus: int = 1
    init_timeout: float = 600.0
    """Seconds the engine waits for every worker to load the model."""
    max_stage_restarts: int = 3
    """How many times the engine replaces workers that died (crash, OOM kill) before the stage is dead; the
    requests a dying worker ran fail with 503, queued ones wait for the new workers."""
    diffusers_load_kwargs: dict[str, Any] = field(default_factory=dict)
    use_diffusers_adapter: bool = False
    """Force the generic diffusers adapter even when a native pipeline exists."""
    enable_progress_bar: bool = False
    load_format: str = "auto"
    """auto = the checkpoint's weights; dummy = only its configs and tokenizers are read, every component is
    built from its config with small random weights (benchmarks of real model sizes without weight files)."""

    def __post_init__(self) -> None:
        if self.max_stage_restarts < 0:
            raise ValueError(f"max_stage_restarts must be >= 0, got {self.max_stage_restarts}")
        if self.load_format not in DIFFUSION_LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(DIFFUSION_LOAD_FORMATS)}, got {self.load_format!r}")

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
    stage_durations: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_exception(cls, exc: BaseException) -> DiffusionOutput:
        if isinstance(exc, OmniClientError):
            return cls(error=exc.message, error_status_code=exc.status_code, error_type=exc.error_type)
        status = exc.status_code if isinstance(exc, OmniError) else 500
        return cls(error=f"{type(exc).__name__}: {exc}", error_status_code=status, error_type=type(exc).__name__)
