"""The connector an edge's `ConnectorConfig` names (as vLLM's `KVConnectorFactory`): the implementations import
the interface in base.py, and only this module imports them, so neither imports the other back."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_omni.config.deploy_config import ConnectorConfig
    from vllm_omni.connectors.base import OmniConnector


def make_connector(config: ConnectorConfig) -> OmniConnector:
    if config.name == "inproc":
        from vllm_omni.connectors.inproc_connector import InProcConnector

        return InProcConnector()
    if config.name == "shm":
        from vllm_omni.connectors.shm_connector import SharedMemoryConnector

        return SharedMemoryConnector(threshold_bytes=config.shm_threshold_bytes)
    if config.name == "ray":
        from vllm_omni.connectors.ray_connector import RayObjectStoreConnector

        return RayObjectStoreConnector(address=config.ray_address)
    raise ValueError(f"unknown connector {config.name!r}")
