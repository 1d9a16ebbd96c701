"""LoRA adapters by name on the diffusion routes, with vLLM's flags and routes.

`--enable-lora` turns the `lora` request field on; `--lora-modules name=path ...` registers adapters at start-up
and, with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (as vLLM), `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`
register and drop them while serving. Every registration is loaded by the diffusion workers first (a control
call: the file is read, matched against the model's layers and sharded there), so a bad file is a 400 at
registration and never reaches a request. A request's names are replaced by their paths here, before it is
queued; the workers keep the resident adapters (LRU of `--max-loras`).
"""

from __future__ import annotations

import argparse
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

from vllm_omni.config.stage_kind import StageKind
from vllm_omni.engine.messages import StageRpcError
from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import OmniDiffusionSamplingParams
from vllm_omni.inputs.lora import LoRARef, parse_lora, parse_refine_lora

LOAD_TIMEOUT_S = 120.0
"""Seconds the workers may take to read and place one adapter."""
_CLIENT_ERROR = "OmniClientError: "


class ServedLoRAs:
    """The adapters this server knows by name; `enabled` is `--enable-lora`."""

    def __init__(self, enabled: bool = False, engine: Any = None) -> None:
        self.enabled = enabled
        self.engine = engine
        self.paths: dict[str, str] = {}

    @classmethod
    def from_args(cls, args: argparse.Namespace, engine: Any) -> ServedLoRAs:
        enabled = bool(getattr(args, "enable_lora", False))
        if getattr(args, "lora_modules", None) and not enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        return cls(enabled, engine)

    def resolve(self, sp: OmniDiffusionSamplingParams, prefix: str = "") -> None:
        """Names -> paths in `sp.lora` and `sp.refine_lora` (OmniClientError naming the field for an unknown
        one, or when off)."""
        sp.lora = self._resolve(sp.lora, "lora", prefix)
        refine = self._resolve(sp.refine_lora, "refine_lora", prefix)
        sp.refine_lora = refine[0] if refine else sp.refine_lora

    def _resolve(self, value: Any, field: str, prefix: str) -> Any:
        param = f"{prefix}{field}"
        try:
            refs = (parse_refine_lora(value),) if field == "refine_lora" else parse_lora(value)
        except OmniClientError as exc:
            raise OmniClientError(exc.message, param=param) from None
        refs = tuple(ref for ref in refs if ref is not None)
        if not refs:
            return value
        if not self.enabled:
            raise OmniClientError(f"{field}: this server was started without --enable-lora", param=param)
        resolved = []
        for ref in refs:
            path = ref.path or self.paths.get(ref.name)
            if path is None:
                known = sorted(self.paths) or 'none (give a "path", or register one)'
                raise OmniClientError(f"{field}: unknown adapter {ref.name!r}; registered: {known}", param=param)
            resolved.append(LoRARef(ref.name, path, ref.scale).as_dict())
        return resolved

    async def load(self, name: str, path: str, replace: bool = False) -> None:
        """Register `name` once every diffusion worker holds the adapter (OmniClientError naming `lora_path`
        for a file they refuse)."""
        if not self.enabled:
            raise OmniClientError("LoRA adapters need a server started with --enable-lora", param="lora_name")
        if not name or not path:
            raise OmniClientError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if name in self.paths and not replace:
            raise OmniClientError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                param="lora_name",
            )
        await self._call("load_lora", name, path)
        old = self.paths.get(name)
        self.paths[name] = path
        if old is not None and old != path and old not in self.paths.values():
            await self._call("unload_lora", old)

    async def unload(self, name: str) -> None:
        if name not in self.paths:
            raise OmniClientError(
                f"The lora adapter '{name}' cannot be found.",
                status_code=404,
                error_type="NotFoundError",
                param="lora_name",
            )
        path = self.paths.pop(name)
        if path not in self.paths.values():
            await self._call("unload_lora", path)

    async def _call(self, method: str, *args: Any) -> None:
        stage_ids = [i for i, kind in enumerate(self.engine.capabilities.stage_kinds) if kind is StageKind.DIFFUSION]
        results = await self.engine.collective_rpc(method, timeout=LOAD_TIMEOUT_S, args=args, stage_ids=stage_ids)
        for result in results:
            if isinstance(result, StageRpcError):
                if _CLIENT_ERROR in result.error:
                    message = result.error.split(_CLIENT_ERROR, 1)[1].split("; rank ", 1)[0]
                    raise OmniClientError(message, param="lora_path")
                raise RuntimeError(f"{method} failed on stage {result.stage_id}: {result.error}")

    def model_cards(self, model_name: str) -> list[dict[str, Any]]:
        """vLLM's /v1/models entries for the adapters: one card each, parented by the base model."""
        return [
            {"id": name, "object": "model", "owned_by": "vllm-omni", "root": path, "parent": model_name}
            for name, path in self.paths.items()
        ]


router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    await raw_request.app.state.loras.load(request.lora_name, request.lora_path, replace=request.load_inplace)
    return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", status_code=200)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    await raw_request.app.state.loras.unload(request.lora_name)
    return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.", status_code=200)
