"""Layer 1b: where and how the stages of a pipeline run (placement, replicas, connectors, defaults).

A `DeployConfig` never changes the graph; it may only refer to stage ids the pipeline defines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field
from pydantic.dataclasses import dataclass

from vllm_omni.config.pipeline_config import FORBID

ConnectorName = Literal["inproc", "shm", "ray"]
WorkerBackend = Literal["mp", "ray"]
PlacementStrategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


@dataclass(config=FORBID)
class ConnectorConfig:
    name: ConnectorName = "inproc"
    """inproc: stage payloads stay in the engine process; shm: tensors go through shared memory; ray: payloads go
    through Ray's object store (stages on different nodes; chosen by itself for an edge whose stages the Ray
    backend places apart)."""
    shm_threshold_bytes: int = Field(default=1_000_000, ge=0)
    """shm only: tensors smaller than this travel inline with the metadata."""
    ray_address: str | None = None
    """ray only: the Ray cluster to join; None = the deploy config's `ray_address` (`--ray-address`)."""


@dataclass(config=FORBID)
class PlacementConfig:
    """Where a stage's ranks run on a Ray cluster (`worker_backend: ray`): one placement-group bundle per rank."""

    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    """Ray resources each rank's bundle asks for beyond its device (a node's custom resource, e.g.
    `{"node:thinker": 1}` for a node started with `ray start --resources '{"node:thinker": 4}'`)."""
    strategy: PlacementStrategy = "STRICT_PACK"
    """Ray's placement-group strategy: STRICT_PACK keeps a stage's sequence / CFG parallel ranks on one node."""


@dataclass(config=FORBID)
class StageDeployConfig:
    stage_id: Annotated[int, Field(ge=0)]
    num_replicas: int = Field(default=1, ge=1)
    devices: str | None = None
    """Comma-separated device ids for this stage's processes (CUDA_VISIBLE_DEVICES); None = inherit."""
    cpu_threads_bind: str | None = None
    """CPU-only hosts, AR stages: the CPUs this stage's vLLM worker binds its OpenMP threads to, in vLLM's
    `VLLM_CPU_OMP_THREADS_BIND` syntax ("0-3", "0,2", "nobind"; "|" between tensor-parallel ranks), set in the
    environment of each of its EngineCores. None: `VLLM_CPU_OMP_THREADS_BIND` if set, else when several AR
    EngineCores share the host each gets its own share of the cores (`split_cpus`), else vLLM's `auto`."""
    placement: PlacementConfig | None = None
    """Ray backend only: the resources this stage's ranks need; None = a device (or one CPU) per rank anywhere."""
    engine_args: dict[str, Any] = Field(default_factory=dict)


def split_cpus(parts: int) -> list[str]:
    """`parts` disjoint CPU lists for AR EngineCores sharing this host, so that their OpenMP threads run in
    parallel instead of time-slicing the one core vLLM's `auto` gives each (core 0 of its NUMA node, the last
    core reserved). One logical CPU per physical core, as vLLM's x86 `auto`; contiguous runs in (NUMA node, id)
    order; one core is left over for the engine process and the EngineCores' schedulers when there are more
    cores than parts; with fewer cores than parts, they are shared round robin."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

    cores: dict[tuple[int, int], int] = {}
    for cpu in get_allowed_cpu_list():
        cores.setdefault((cpu.numa_node, cpu.physical_core), cpu.id)
    ids = [cores[key] for key in sorted(cores)]
    if len(ids) < parts:
        return [str(ids[i % len(ids)]) for i in range(parts)]
    usable = ids[:-1] if len(ids) > parts else ids
    sizes = [len(usable) // parts + (k < len(usable) % parts) for k in range(parts)]
    starts = [sum(sizes[:k]) for k in range(parts)]
    return [",".join(str(i) for i in usable[start:start + size]) for start, size in zip(starts, sizes, strict=True)]


def cpus_left_by(binds: list[tuple[str, int]]) -> int:
    """How many of this host's logical CPUs the vLLM CPU workers of AR EngineCores leave free, one
    (`VLLM_CPU_OMP_THREADS_BIND` value, tensor x pipeline parallel ranks) per EngineCore, at least 1. An explicit
    CPU list binds its CPUs; `auto` (vLLM's) one logical CPU per physical core of a NUMA node per rank, less the
    reserved ones (`VLLM_CPU_NUM_OF_RESERVED_CPU`, else one per rank), which it leaves to the other processes;
    `nobind` nothing (its threads float)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, parse_id_list

    allowed = get_allowed_cpu_list()
    bound: set[int] = set()
    for bind, ranks in binds:
        if bind == "nobind":
            continue
        if bind != "auto":
            bound.update(cpu for part in bind.split("|") for cpu in parse_id_list(part))
            continue
        nodes = sorted({cpu.numa_node for cpu in allowed})[:ranks]
        cores: dict[tuple[int, int], int] = {}
        for cpu in allowed:
            if cpu.numa_node in nodes:
                cores.setdefault((cpu.numa_node, cpu.physical_core), cpu.id)
        # As the EngineCore's worker will read it when it starts (vllm.envs may have cached this process's).
        reserved = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", ranks))
        ids = [cores[key] for key in sorted(cores)]
        bound.update(ids[:len(ids) - reserved] if len(ids) > reserved else ids)
    return max(1, len({cpu.id for cpu in allowed} - bound))


@dataclass(config=FORBID)
class DeployConfig:
    stages: list[StageDeployConfig] = Field(default_factory=list)
    connector: ConnectorConfig = Field(default_factory=ConnectorConfig)
    """Connector for every stage edge unless `edge_connectors` names one ("0->1")."""
    edge_connectors: dict[str, ConnectorConfig] = Field(default_factory=dict)
    stage_init_timeout: float = Field(default=600.0, gt=0)
    """Seconds each stage may take to become ready."""
    worker_backend: WorkerBackend = "mp"
    """mp: every stage's workers are processes of this host; ray: diffusion ranks are Ray actors placed by each
    stage's `placement` (`--worker-backend`)."""
    ray_address: str | None = None
    """Ray backend: the cluster to join (`--ray-address`; "auto" or host:port); None = $RAY_ADDRESS, else a
    cluster started on this host."""

    def for_stage(self, stage_id: int) -> StageDeployConfig:
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        return StageDeployConfig(stage_id=stage_id)

    def connector_for(self, src: int, dst: int) -> ConnectorConfig:
        """The connector `edge_connectors` names for the edge; else Ray's object store when the Ray backend places
        its two stages apart (their `placement`s differ: shared memory and the engine process's memory do not
        reach another node), else `connector`. A ray connector joins the deploy config's cluster."""
        connector = self.edge_connectors.get(f"{src}->{dst}")
        if connector is None:
            apart = self.worker_backend == "ray" and self.for_stage(src).placement != self.for_stage(dst).placement
            connector = ConnectorConfig(name="ray") if apart else self.connector
        if connector.name == "ray" and connector.ray_address is None:
            connector = ConnectorConfig(name="ray", ray_address=self.ray_address)
        return connector

    @classmethod
    def from_yaml(cls, path: str | Path) -> DeployConfig:
        path = Path(path)
        if not path.exists():
            bundled = Path(__file__).parent.parent / "deploy" / f"{path.name.removesuffix('.yaml')}.yaml"
            if not bundled.exists():
                raise FileNotFoundError(f"deploy config {path} not found (nor bundled {bundled.name})")
            path = bundled
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"deploy config {path} must be a mapping")
        return cls(**data)
