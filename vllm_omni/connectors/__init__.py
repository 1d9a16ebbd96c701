"""OmniConnector: moves stage payloads (tensors + metadata) between stages. It transports; it never routes."""

from vllm_omni.connectors.base import OmniConnector, PayloadHandle, StagePayload
from vllm_omni.connectors.factory import make_connector

__all__ = ["OmniConnector", "PayloadHandle", "StagePayload", "make_connector"]
