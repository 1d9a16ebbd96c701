"""Configuration layers: PipelineConfig + DeployConfig -> (resolve once) -> VllmOmniConfig."""

from vllm_omni.catalog.registry import register_pipeline  # the public extension point, kept here too
from vllm_omni.config.deploy_config import ConnectorConfig, DeployConfig, StageDeployConfig
from vllm_omni.config.omni_config import StageConfigFactory, VllmOmniConfig
from vllm_omni.config.pipeline_config import PipelineConfig, PipelineStageConfig, StageExecutionType
from vllm_omni.config.stage_config import (
    BaseVllmOmniStageConfig,
    VllmOmniARStageConfig,
    VllmOmniDiffusionStageConfig,
    VllmOmniGenerationStageConfig,
)
from vllm_omni.config.stage_kind import StageKind

__all__ = [
    "BaseVllmOmniStageConfig",
    "ConnectorConfig",
    "DeployConfig",
    "PipelineConfig",
    "PipelineStageConfig",
    "StageConfigFactory",
    "StageDeployConfig",
    "StageExecutionType",
    "StageKind",
    "VllmOmniARStageConfig",
    "VllmOmniConfig",
    "VllmOmniDiffusionStageConfig",
    "VllmOmniGenerationStageConfig",
    "register_pipeline",
]
