"""Base of the Qwen3-Omni stages' KV connectors, which move no KV.

vLLM's model interface tells a forward nothing about which request owns which rows. Its KV-connector plugin
interface does carry per-step, per-request metadata from the scheduler to the worker, and a KV block belongs to
one request, so a connector that sends each request's block ids lets the model map rows to requests by their KV
slot. The connectors here use only that: every KV-transfer hook of `KVConnectorBase_V1` is a no-op.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


def slot_connector_engine_kwargs(connector: str, module: str, extension: str) -> dict[str, Any]:
    """vLLM engine arguments that load `module.connector` as the stage's KV connector and `module.extension` as
    its worker extension (the RPCs its output collector calls)."""
    return {"kv_transfer_config": {"kv_connector": connector, "kv_connector_module_path": module,
                                   "kv_role": "kv_both"},
            "worker_extension_cls": f"{module}.{extension}"}


class SlotConnector(KVConnectorBase_V1):
    """No external KV is matched, loaded or saved; subclasses build and read the step metadata."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
