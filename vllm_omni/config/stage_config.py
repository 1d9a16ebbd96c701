"""Layer 3: one resolved, transport-safe config per stage (plain data, picklable).

Engine objects (vLLM `VllmConfig`, `OmniDiffusionConfig`) are materialized from these inside the process
that owns the engine, never here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

from pydantic import Field
from pydantic.dataclasses import dataclass

from vllm_omni.config.deploy_config import PlacementConfig, WorkerBackend
from vllm_omni.config.pipeline_config import FORBID, EdgeStreamConfig, OutputModality
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.errors import OmniClientError


def device_ids(devices: str) -> list[str]:
    """`CUDA_VISIBLE_DEVICES`-style "0,1,2" -> ["0", "1", "2"]."""
    return [d.strip() for d in devices.split(",") if d.strip()]


@dataclass(config=FORBID)
class BaseVllmOmniStageConfig:
    stage_id: int
    model: str
    """Local path or hub id of this stage's model (tiny/ names already resolved)."""
    inputs: list[int] = Field(default_factory=list)
    stream_inputs: dict[int, EdgeStreamConfig] = Field(default_factory=dict)
    input_processor: str | None = None
    output_collector: str | None = None
    final_output: bool = False
    final_output_type: OutputModality | None = None
    num_replicas: int = 1
    devices: str | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Merged engine arguments (pipeline defaults < deploy < global overrides < per-stage overrides)."""
    default_sampling_params: dict[str, Any] = Field(default_factory=dict)
    stage_init_timeout: float = 600.0
    worker_backend: WorkerBackend = "mp"
    ray_address: str | None = None
    """Ray backend: the cluster to join (None = $RAY_ADDRESS, else one on this host)."""
    placement: PlacementConfig | None = None
    """Ray backend: what each of the stage's ranks needs of a node (None = a device or one CPU anywhere)."""
    kind: ClassVar[StageKind]

    @property
    def stage_type(self) -> str:
        """The kind's user-visible name ("llm" for AR)."""
        return self.kind.stage_type

    @property
    def name(self) -> str:
        return f"stage-{self.stage_id}-{self.stage_type}"

    def streamed_input(self) -> int | None:
        """The upstream stage whose output streams into this one, if any."""
        return next((src for src, edge in self.stream_inputs.items() if edge.stream), None)

    @staticmethod
    def check_args(engine_args: dict[str, Any]) -> None:
        """Refuse values this stage's engine cannot honour, at resolution (before any process starts)."""

    def replica_devices(self, replica: int) -> str | None:
        """Replica `replica`'s share of the stage's devices: the list cut into `num_replicas` equal contiguous
        parts (checked at resolution), so replicas never share a device; None = what the process sees (CPU)."""
        if self.devices is None or self.num_replicas == 1:
            return self.devices
        ids = device_ids(self.devices)
        per = len(ids) // self.num_replicas
        return ",".join(ids[replica * per:(replica + 1) * per])

    def spawn_env(self, replica: int) -> dict[str, str]:
        """The environment replica `replica`'s processes are started with beyond the engine process's own."""
        env = {}
        devices = self.replica_devices(replica)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        if self.worker_backend == "ray" and self.ray_address is not None:
            env["RAY_ADDRESS"] = self.ray_address  # the cluster `ray.init()` joins inside the stage's processes
        return env


@dataclass(config=FORBID)
class VllmOmniARStageConfig(BaseVllmOmniStageConfig):
    kind: ClassVar[StageKind] = StageKind.AR
    cpu_threads_bind: list[str] | None = None
    """Per replica, the `VLLM_CPU_OMP_THREADS_BIND` of its EngineCore (deploy config or `split_cpus`); None:
    the environment's."""

    def omp_env(self, replica: int) -> dict[str, str]:
        """The environment this replica's EngineCore is started with beyond the engine process's own."""
        if self.cpu_threads_bind is None:
            return {}
        return {"VLLM_CPU_OMP_THREADS_BIND": self.cpu_threads_bind[replica]}

    def spawn_env(self, replica: int) -> dict[str, str]:
        return {**super().spawn_env(replica), **self.omp_env(replica)}

    @staticmethod
    def known_args() -> frozenset[str]:
        return _ar_arg_names()

    @staticmethod
    def check_args(engine_args: dict[str, Any]) -> None:
        restarts = engine_args.get("max_stage_restarts")
        if restarts is not None and (not isinstance(restarts, int) or restarts < 0):
            raise OmniClientError(f"max_stage_restarts must be an integer >= 0, got {restarts!r}",
                                  param="max_stage_restarts")

    @property
    def max_stage_restarts(self) -> int:
        """Times the stage re-creates an EngineCore that died before it is dead: the diffusion stages'
        `--max-stage-restarts`, read from the same engine arguments (it is not a vLLM engine argument)."""
        value = self.engine_args.get("max_stage_restarts")
        return _DEFAULT_MAX_STAGE_RESTARTS if value is None else value

    def make_engine_args(self):
        from vllm.engine.arg_utils import AsyncEngineArgs

        args = {k: v for k, v in self.engine_args.items() if k not in _AR_STAGE_ARGS}
        if self.worker_backend == "ray":  # vLLM places the stage's ranks on the cluster itself
            args["distributed_executor_backend"] = "ray"
        return AsyncEngineArgs(model=self.model, **args)


@dataclass(config=FORBID)
class VllmOmniGenerationStageConfig(BaseVllmOmniStageConfig):
    kind: ClassVar[StageKind] = StageKind.GENERATION
    torch_num_threads: int | None = None
    """The torch threads of the engine process that runs this stage: its `torch_num_threads` engine argument,
    else its share of the host's CPUs (resolved with the pipeline)."""

    @staticmethod
    def known_args() -> frozenset[str]:
        return frozenset({"model_class", "dtype", "device", "max_batch_size", "torch_num_threads"})

    @staticmethod
    def check_args(engine_args: dict[str, Any]) -> None:
        from vllm_omni.diffusion.data import check_torch_num_threads

        check_torch_num_threads(engine_args.get("torch_num_threads"))


@dataclass(config=FORBID)
class VllmOmniDiffusionStageConfig(BaseVllmOmniStageConfig):
    kind: ClassVar[StageKind] = StageKind.DIFFUSION
    torch_num_threads: int | None = None
    """The torch threads of each of this stage's worker processes: its `torch_num_threads` engine argument,
    else its share of the host's CPUs (resolved with the pipeline)."""

    @staticmethod
    def known_args() -> frozenset[str]:
        return _diffusion_arg_names()

    @staticmethod
    def check_args(engine_args: dict[str, Any]) -> None:
        from vllm_omni.diffusion.data import check_diffusion_args

        check_diffusion_args(engine_args)

    def make_od_config(self):
        from vllm_omni.diffusion.data import OmniDiffusionConfig, RayPlacement

        ray = None
        if self.worker_backend == "ray":
            placement = self.placement or PlacementConfig()
            ray = RayPlacement(address=self.ray_address, resources=dict(placement.resources),
                               strategy=placement.strategy)
        return OmniDiffusionConfig.from_kwargs(model=self.model, stage_id=self.stage_id, ray=ray,
                                               **{**self.engine_args, "torch_num_threads": self.torch_num_threads})


# AR stage arguments that are the stage's own, not vLLM's; the default is the diffusion stages' one.
_AR_STAGE_ARGS = frozenset({"max_stage_restarts"})
_DEFAULT_MAX_STAGE_RESTARTS = 3

StageConfig = VllmOmniARStageConfig | VllmOmniGenerationStageConfig | VllmOmniDiffusionStageConfig


@functools.cache
def _ar_arg_names() -> frozenset[str]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return (frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs)) - {"model"}) | _AR_STAGE_ARGS


@functools.cache
def _diffusion_arg_names() -> frozenset[str]:
    from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig

    names = {f.name for f in dataclasses.fields(OmniDiffusionConfig)}
    names |= {f.name for f in dataclasses.fields(DiffusionParallelConfig)}
    return frozenset(names - {"model", "stage_id", "ray"})
