"""The environment variables vllm-omni itself reads, in one place: typed, documented, read on each access.

As `vllm/envs.py`: `vllm_omni.envs.NAME` evaluates the variable now (so a test's `monkeypatch.setenv` and a
spawned worker's environment are honoured), and nothing else in the package calls `os.environ` for these.
vLLM's own variables (`VLLM_LOGGING_LEVEL`, ...) stay in `vllm.envs`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    DIFFUSION_ATTENTION_BACKEND: str | None = None
    VLLM_OMNI_VIDEO_SYNC_TIMEOUT: float = 14400.0
    VLLM_OMNI_TINY_CACHE: Path = Path.home() / ".cache" / "vllm_omni" / "tiny"


ENGINE_CORE_FORKS_WORKERS = "_VLLM_OMNI_ENGINE_CORE_FORKS_WORKERS"
"""Set by our front end, beside the `VLLM_WORKER_MULTIPROC_METHOD=spawn` it chose, only when the user chose no
start method: an explicit `VLLM_WORKER_MULTIPROC_METHOD` is kept in every process. Internal, not a setting (no
`VLLM_` prefix: vLLM warns in every process about a `VLLM_*` variable it does not know)."""


def _float(name: str, default: float) -> float:
    text = os.environ.get(name)
    try:
        return default if text is None else float(text)
    except ValueError:
        raise ValueError(f"env {name} must be a number of seconds, got {text!r}") from None


environment_variables: dict[str, Callable[[], Any]] = {
    # Attention backend of diffusion layers when the stage config names none (see
    # `OmniDiffusionConfig.diffusion_attention_backend`); unset = the platform default.
    "DIFFUSION_ATTENTION_BACKEND": lambda: os.environ.get("DIFFUSION_ATTENTION_BACKEND") or None,
    # Seconds `POST /v1/videos/sync` waits for the engine before answering 504 and aborting the request.
    "VLLM_OMNI_VIDEO_SYNC_TIMEOUT": lambda: _float("VLLM_OMNI_VIDEO_SYNC_TIMEOUT", 14400.0),
    # Where the tiny random-weight checkpoints (`tiny/<name>`) are written once and reused.
    "VLLM_OMNI_TINY_CACHE": lambda: Path(
        os.environ.get("VLLM_OMNI_TINY_CACHE", Path.home() / ".cache" / "vllm_omni" / "tiny")),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
