"""Joining a Ray cluster, for the processes that use one (the diffusion core of `--worker-backend ray`, the engine
process of a `ray` connector): light to import, since an actor that only moves payloads imports it too."""

from __future__ import annotations

import os
import socket

from vllm_omni.errors import OmniClientError

_PROBE_TIMEOUT_S = 5.0


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` (None: $RAY_ADDRESS, else a new one on this host); an address where no
    cluster answers fails in seconds naming the flag (Ray's own client retries for minutes)."""
    import ray

    target = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        joined = ray.get_runtime_context().gcs_address
        if target not in (None, "auto", joined):
            raise OmniClientError(
                f"--ray-address {target!r}: this process already joined the Ray cluster at {joined}",
                param="ray_address",
            )
        return
    if target and target != "auto" and not target.startswith("ray://"):
        host, _, port = target.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=_PROBE_TIMEOUT_S).close()
        except (OSError, ValueError) as exc:
            raise OmniClientError(
                f"--ray-address {target!r}: no Ray cluster answers there ({exc})", param="ray_address"
            ) from None
    try:
        ray.init(address=address, logging_level="WARNING")  # the ranks' output reaches this process's log
    except ConnectionError as exc:
        raise OmniClientError(f"--ray-address {target!r}: {' '.join(str(exc).split())}", param="ray_address") from None
