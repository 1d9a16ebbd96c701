"""Layer 1b: where and how the stages of a pipeline run (placement, replicas, connectors, defaults).

A `DeployConfig` never changes the graph; it may only refer to stage ids the pipeline defines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field
from pydantic.dataclasses import dataclass

from vllm_omni.config.pipeline_config import FORBID

ConnectorName = Literal["inproc", "shm"]


@dataclass(config=FORBID)
class ConnectorConfig:
    name: ConnectorName = "inproc"
    """inproc: stage payloads stay in the engine process; shm: tensors go through shared memory."""
    shm_threshold_bytes: int = Field(default=1_000_000, ge=0)
    """shm only: tensors smaller than this travel inline with the metadata."""


@dataclass(config=FORBID)
class StageDeployConfig:
    stage_id: Annotated[int, Field(ge=0)]
    num_replicas: int = Field(default=1, ge=1)
    devices: str | None = None
    """Comma-separated device ids for this stage's processes (CUDA_VISIBLE_DEVICES); None = inherit."""
    engine_args: dict[str, Any] = Field(default_factory=dict)


@dataclass(config=FORBID)
class DeployConfig:
    stages: list[StageDeployConfig] = Field(default_factory=list)
    connector: ConnectorConfig = Field(default_factory=ConnectorConfig)
    """Connector for every stage edge unless `edge_connectors` names one ("0->1")."""
    edge_connectors: dict[str, ConnectorConfig] = Field(default_factory=dict)
    stage_init_timeout: float = Field(default=600.0, gt=0)
    """Seconds each stage may take to become ready."""

    def for_stage(self, stage_id: int) -> StageDeployConfig:
        for stage in self.stages:
            if stage.stage_id == stage_id:
                return stage
        return StageDeployConfig(stage_id=stage_id)

    def connector_for(self, src: int, dst: int) -> ConnectorConfig:
        return self.edge_connectors.get(f"{src}->{dst}", self.connector)

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
