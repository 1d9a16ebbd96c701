"""Layer 2: resolve a model + authoring configs + overrides into one `VllmOmniConfig`, exactly once.

Precedence for a stage's engine arguments, lowest first: the pipeline's model defaults, the deploy
config, global Python/CLI arguments (applied to every stage that understands them), and
`stage_overrides={"<stage_id>": {...}}`. An argument no stage understands is an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic.dataclasses import dataclass

from vllm_omni.config.deploy_config import (
    ConnectorConfig,
    DeployConfig,
    StageDeployConfig,
    cpus_left_by,
    split_cpus,
)
from vllm_omni.config.pipeline_config import (
    AR_DOWNSTREAM_FIELDS,
    FORBID,
    HAND_OFF_FIELDS,
    EdgeField,
    EdgeStreamConfig,
    PipelineConfig,
    PipelineStageConfig,
)
from vllm_omni.config.stage_config import (
    StageConfig,
    VllmOmniARStageConfig,
    VllmOmniDiffusionStageConfig,
    VllmOmniGenerationStageConfig,
    device_ids,
)
from vllm_omni.config.stage_kind import StageKind
from vllm_omni.errors import OmniClientError

_STAGE_CLASSES = {
    StageKind.AR: VllmOmniARStageConfig,
    StageKind.GENERATION: VllmOmniGenerationStageConfig,
    StageKind.DIFFUSION: VllmOmniDiffusionStageConfig,
}

@dataclass(config=FORBID)
class VllmOmniConfig:
    """Everything every process of one engine needs; plain data, safe to pickle or send."""

    model: str
    """The model as the user named it (served name)."""
    model_path: str
    pipeline_name: str
    stages: list[StageConfig]
    connectors: dict[str, ConnectorConfig] = Field(default_factory=dict)
    """Connector per edge "src->dst"."""
    init_timeout: float | None = None
    """Seconds the whole pipeline may take to start; None = the sum of the stages' `stage_init_timeout`."""

    @property
    def stage_kinds(self) -> list[StageKind]:
        return [s.kind for s in self.stages]

    @property
    def stage_types(self) -> list[str]:
        return [s.stage_type for s in self.stages]

    def connector_for(self, src: int, dst: int) -> ConnectorConfig:
        return self.connectors.get(f"{src}->{dst}", ConnectorConfig())

    @classmethod
    def from_pipeline_config(
        cls,
        model: str,
        model_path: str,
        pipeline: PipelineConfig,
        deploy: DeployConfig,
        global_args: Mapping[str, Any],
        stage_overrides: Mapping[str, Mapping[str, Any]],
        init_timeout: float | None = None,
    ) -> VllmOmniConfig:
        _check_stage_ids(deploy, stage_overrides, len(pipeline.stages))
        for spec in pipeline.stages:
            _check_edge_fields(spec)
        stages: list[StageConfig] = []
        used_globals: set[str] = set()
        for spec in pipeline.stages:
            stage_cls = _STAGE_CLASSES[spec.execution_type]
            known = stage_cls.known_args()
            stage_deploy = deploy.for_stage(spec.stage_id)
            overrides = dict(stage_overrides.get(str(spec.stage_id), {}))
            args = {**spec.engine_args, **stage_deploy.engine_args}
            for key, value in global_args.items():
                if key in known:
                    args[key] = value
                    used_globals.add(key)
            args.update(overrides)
            unknown = sorted(set(args) - known)
            if unknown:
                raise OmniClientError(
                    f"stage {spec.stage_id} ({spec.execution_type.value}) does not accept engine "
                    f"argument(s) {unknown}", param=unknown[0])
            stage_cls.check_args(args)
            num_replicas = stage_deploy.num_replicas
            if spec.execution_type is StageKind.DIFFUSION:
                num_replicas = _diffusion_replicas(spec.stage_id, args, num_replicas)
            if stage_deploy.devices is not None and len(device_ids(stage_deploy.devices)) % num_replicas:
                raise OmniClientError(f"stage {spec.stage_id}: devices {stage_deploy.devices!r} cannot be split "
                                      f"evenly over its {num_replicas} replicas", param="devices")
            _check_placement(spec.stage_id, spec.execution_type, deploy.worker_backend, stage_deploy)
            stages.append(stage_cls(
                stage_id=spec.stage_id,
                model=_stage_model(model_path, spec.model, spec.model_subfolder),
                inputs=list(spec.inputs),
                stream_inputs=dict(spec.stream_inputs),
                input_processor=spec.input_processor,
                output_collector=spec.output_collector,
                final_output=spec.final_output,
                final_output_type=spec.final_output_type,
                num_replicas=num_replicas,
                devices=stage_deploy.devices,
                engine_args=args,
                default_sampling_params=dict(spec.default_sampling_params),
                stage_init_timeout=deploy.stage_init_timeout,
                worker_backend=deploy.worker_backend,
                ray_address=deploy.ray_address,
                placement=stage_deploy.placement,
            ))
        _bind_cpu_threads(stages, deploy)
        _split_torch_threads(stages)
        _split_memory(stages)
        unused = sorted(set(global_args) - used_globals)
        if unused:
            raise OmniClientError(f"unknown engine argument(s) {unused} for pipeline {pipeline.name!r} "
                                  f"(stage types {[s.stage_type for s in stages]})", param=unused[0])
        connectors = {f"{src}->{s.stage_id}": deploy.connector_for(src, s.stage_id)
                      for s in stages for src in s.inputs}
        return cls(model=model, model_path=model_path, pipeline_name=pipeline.name, stages=stages,
                   connectors=connectors, init_timeout=init_timeout)


def _check_placement(stage_id: int, kind: StageKind, backend: str, stage_deploy: StageDeployConfig) -> None:
    """What the Ray backend can place: diffusion ranks (our actors) and AR ranks (vLLM's Ray executor, where
    vLLM's platform has one); a GENERATION stage runs in the engine process."""
    if backend != "ray":
        if stage_deploy.placement is not None:
            raise OmniClientError(f"stage {stage_id}: placement needs --worker-backend ray (the deploy config's "
                                  f"worker_backend is {backend})", param="worker_backend")
        return
    if kind is StageKind.DIFFUSION:
        return
    if stage_deploy.placement is not None:
        why = "vLLM's Ray executor places AR ranks itself" if kind is StageKind.AR else "it runs in the engine"
        raise OmniClientError(f"stage {stage_id} ({kind.stage_type}): placement applies to diffusion stages; {why}",
                              param="placement")
    if kind is StageKind.AR:
        from vllm.platforms import current_platform

        if not current_platform.ray_device_key:
            raise OmniClientError(f"stage {stage_id} (llm): --worker-backend ray runs AR stages on vLLM's Ray "
                                  f"executor, which vLLM's {current_platform.device_name} platform does not have",
                                  param="worker_backend")


def _bind_cpu_threads(stages: list[StageConfig], deploy: DeployConfig) -> None:
    """Each AR EngineCore's OpenMP CPU set on a CPU-only host: the deploy config's `cpu_threads_bind`; when no
    stage names one, `VLLM_CPU_OMP_THREADS_BIND` is unset and several AR EngineCores share the host, disjoint
    shares of the cores (`split_cpus`), the same for streamed and store-and-forward pipelines."""
    explicit = {s.stage_id: deploy.for_stage(s.stage_id).cpu_threads_bind for s in stages}
    named = [s for s in stages if explicit[s.stage_id] is not None]
    for stage in named:
        if stage.kind is not StageKind.AR:
            raise OmniClientError(f"stage {stage.stage_id}: cpu_threads_bind applies to AR stages (vLLM CPU "
                                  f"workers), not {stage.stage_type}", param="cpu_threads_bind")
    ar = [s for s in stages if s.kind is StageKind.AR]
    engine_cores = sum(s.num_replicas for s in ar)
    if not named and (engine_cores < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ):
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        if named:
            raise OmniClientError(f"stage {named[0].stage_id}: cpu_threads_bind applies to CPU-only hosts (vLLM "
                                  f"CPU workers); this one is {current_platform.device_name}",
                                  param="cpu_threads_bind")
        return
    if named:
        for stage in named:
            stage.cpu_threads_bind = [explicit[stage.stage_id]] * stage.num_replicas
        return
    shares = iter(split_cpus(engine_cores))
    for stage in ar:
        stage.cpu_threads_bind = [next(shares) for _ in range(stage.num_replicas)]


def _split_torch_threads(stages: list[StageConfig]) -> None:
    """Each diffusion and generation stage's `torch_num_threads` left unset: the CPUs the AR stages' vLLM CPU
    workers leave free (`cpus_left_by`; all of them on an accelerator host) divided among the processes that
    compute beside them: every diffusion rank of every replica, and the engine process once for all its
    generation stages (they share its one torch pool)."""
    computing = [s for s in stages if s.kind is not StageKind.AR]
    for stage in computing:
        stage.torch_num_threads = stage.engine_args.get("torch_num_threads")
    if all(s.torch_num_threads is not None for s in computing):
        return
    from vllm.platforms import current_platform

    from vllm_omni.diffusion.data import diffusion_world_size

    binds = []
    if current_platform.is_cpu():
        for stage in (s for s in stages if s.kind is StageKind.AR):
            ranks = (stage.engine_args.get("tensor_parallel_size") or 1) * (
                stage.engine_args.get("pipeline_parallel_size") or 1)
            for replica in range(stage.num_replicas):
                bind = (stage.cpu_threads_bind[replica] if stage.cpu_threads_bind is not None
                        else os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
                binds.append((bind, ranks))
    processes = any(s.kind is StageKind.GENERATION for s in stages) + sum(
        diffusion_world_size(s.engine_args) * s.num_replicas for s in stages if s.kind is StageKind.DIFFUSION)
    share = max(1, cpus_left_by(binds) // processes)
    for stage in computing:
        if stage.torch_num_threads is None:
            stage.torch_num_threads = share


MEMORY_SHARED_BY_AR_STAGES = {"accelerator": 0.92, "cpu": 0.5}
"""What the AR EngineCores that share a device take together when no stage sets its memory: vLLM's default
`gpu_memory_utilization` on an accelerator; half the host's memory on CPU, where a vLLM CPU worker's KV cache
(`gpu_memory_utilization` x the node's memory) must be free when it is allocated, beside every other process of
the pipeline and the host."""


def _split_memory(stages: list[StageConfig]) -> None:
    """Give the AR stages that share a device disjoint shares of it where the user set none: each vLLM
    EngineCore otherwise takes vLLM's default of 92% of the device (on CPU: of the host's memory), and the
    second to start fails for want of memory. A stage keeps its own `gpu_memory_utilization` or
    `kv_cache_memory_bytes`, as does every stage on CPU under `VLLM_CPU_KVCACHE_SPACE`."""
    ar = [s for s in stages if s.kind is StageKind.AR]
    replicas = [s.replica_devices(r) for s in ar for r in range(s.num_replicas)]
    if len(replicas) < 2:
        return
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    if cpu and "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return

    def overlap(a: str | None, b: str | None) -> bool:  # None: every device the process sees
        return a is None or b is None or bool(set(device_ids(a)) & set(device_ids(b)))

    total = MEMORY_SHARED_BY_AR_STAGES["cpu" if cpu else "accelerator"]
    for stage in ar:
        if {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(stage.engine_args):
            continue
        sharing = max(sum(overlap(mine, other) for other in replicas)
                      for mine in (stage.replica_devices(r) for r in range(stage.num_replicas)))
        if sharing > 1:
            stage.engine_args["gpu_memory_utilization"] = round(total / sharing, 3)


def _check_edge_fields(spec: PipelineStageConfig) -> None:
    """Refuse an edge field that nothing reads on its edge (it would be accepted and ignored): the hand-off
    sizes apply to a streamed edge (`idle_chunk_growth` only into an AR stage), anything else only to an input
    processor that declares it reads it."""
    from vllm_omni.catalog.edges import processor_reads

    def orchestrator_reads(edge: EdgeStreamConfig, name: EdgeField) -> bool:
        return (edge.stream and name in HAND_OFF_FIELDS
                and (name not in AR_DOWNSTREAM_FIELDS or spec.execution_type is StageKind.AR))

    for src, edge in spec.stream_inputs.items():
        unused = [f for f in edge.set_fields() if not orchestrator_reads(edge, f)]
        if unused and spec.input_processor is not None:
            read = processor_reads(spec.input_processor).edge_fields
            unused = [f for f in unused if f not in read]
        if unused:
            path = f"stages[{spec.stage_id}].stream_inputs[{src}].{unused[0]}"
            why = ("a store-and-forward edge (stream: false) hands the output on once, and input processor "
                   if not edge.stream and unused[0] in HAND_OFF_FIELDS
                   else "only a stream-fed AR stage waits for input, and input processor "
                   if unused[0] in AR_DOWNSTREAM_FIELDS else "input processor ")
            raise OmniClientError(f"{path} (edge {src}->{spec.stage_id}) is not used: {why}"
                                  f"{spec.input_processor!r} does not read it", param=path)


def _diffusion_replicas(stage_id: int, args: dict[str, Any], deploy_replicas: int) -> int:
    """A diffusion stage's `data_parallel_size` is its replica count (vLLM's flag, the deploy config's
    `num_replicas`); it leaves the engine arguments, since each replica is a whole engine of its own. Except
    under distributed layerwise offload, where the data-parallel ranks share each block's weights: they are the
    ranks of one engine (one replica)."""
    if args.get("enable_distributed_layerwise_offload"):
        return deploy_replicas
    parallel = args.get("parallel_config")
    nested = parallel.pop("data_parallel_size", None) if isinstance(parallel, dict) else None
    size = args.pop("data_parallel_size", None)
    size = nested if size is None else size
    if size is None or size == 1:
        return deploy_replicas
    if not isinstance(size, int) or size < 1:
        raise OmniClientError(f"data_parallel_size must be an integer >= 1, got {size!r}",
                              param="data_parallel_size")
    if deploy_replicas not in (1, size):
        raise OmniClientError(f"stage {stage_id}: data_parallel_size={size} (--data-parallel-size) contradicts "
                              f"the deploy config's num_replicas={deploy_replicas}", param="data_parallel_size")
    return size


class StageConfigFactory:
    """The one place that turns (model, configs, overrides) into a `VllmOmniConfig`."""


    @classmethod
    def create_from_model(cls, model: str, **kwargs: Any) -> VllmOmniConfig:
        from vllm_omni.catalog.tiny import resolve_model

        pipeline = kwargs.pop("pipeline_config", None)
        deploy = kwargs.pop("deploy_config", None)
        stage_overrides = kwargs.pop("stage_overrides", None) or {}
        deploy_overrides = {key: value for key in ("stage_init_timeout", "worker_backend", "ray_address")
                            if (value := kwargs.pop(key, None)) is not None}
        init_timeout = kwargs.pop("init_timeout", None)
        if isinstance(stage_overrides, str):
            stage_overrides = json.loads(stage_overrides)
        stage_overrides = {str(k): v for k, v in stage_overrides.items()}

        model_path = resolve_model(model)
        if pipeline is None:
            pipeline = pipeline_for_model(model_path)
        elif not isinstance(pipeline, PipelineConfig):
            pipeline = PipelineConfig.from_yaml(pipeline)
        if deploy is None:
            deploy = DeployConfig()
        elif not isinstance(deploy, DeployConfig):
            deploy = DeployConfig.from_yaml(deploy)
        if deploy_overrides:
            deploy = dataclasses.replace(deploy, **deploy_overrides)
        if init_timeout is not None and pipeline_has(pipeline, StageKind.DIFFUSION):
            kwargs["init_timeout"] = init_timeout  # a diffusion stage also bounds its own worker start-up
        return VllmOmniConfig.from_pipeline_config(model, model_path, pipeline, deploy, kwargs, stage_overrides,
                                                   init_timeout)


def pipeline_has(pipeline: PipelineConfig, execution_type: StageKind) -> bool:
    return any(s.execution_type == execution_type for s in pipeline.stages)


def pipeline_for_model(model_path: str) -> PipelineConfig:
    """model_index.json -> one DIFFUSION stage; a registered architecture -> its pipeline; else one AR stage."""
    if _read_json(model_path, "model_index.json") is not None:
        return PipelineConfig.single_stage("diffusion", StageKind.DIFFUSION)
    hf_config = _read_json(model_path, "config.json")
    if hf_config is None:
        raise OmniClientError(f"{model_path} is not a model checkpoint: it has neither model_index.json (a diffusers "
                              "pipeline) nor config.json (a transformers model)", param="model")
    from vllm_omni.catalog.registry import MODEL_REGISTRY

    factory = MODEL_REGISTRY.topology_for([*hf_config.get("architectures", []), hf_config.get("model_type")])
    if factory is not None:
        return factory()
    return PipelineConfig.single_stage("llm", StageKind.AR)


def _read_json(model_path: str, filename: str) -> dict[str, Any] | None:
    local = Path(model_path) / filename
    if Path(model_path).is_dir():
        return json.loads(local.read_text()) if local.exists() else None
    if model_path.startswith((".", "/", "~")):
        raise OmniClientError(f"model {model_path!r} is not a directory", param="model")
    from vllm_omni.catalog.resolution import fetch_hub_file

    try:
        path = fetch_hub_file(model_path, filename)
    except FileNotFoundError as exc:
        raise OmniClientError(str(exc), param="model") from exc
    return None if path is None else json.loads(path.read_text())


def _stage_model(model_path: str, stage_model: str | None, subfolder: str | None) -> str:
    if stage_model is not None:
        from vllm_omni.catalog.tiny import resolve_model

        return resolve_model(stage_model)
    return str(Path(model_path) / subfolder) if subfolder else model_path


def _check_stage_ids(deploy: DeployConfig, overrides: Mapping[str, Any], num_stages: int) -> None:
    bad = sorted({s.stage_id for s in deploy.stages if s.stage_id >= num_stages}
                 | {int(k) for k in overrides if not k.isdigit() or int(k) >= num_stages})
    if bad:
        raise OmniClientError(f"stage id(s) {bad} not in the pipeline (stages 0..{num_stages - 1})",
                              param="stage_overrides")
