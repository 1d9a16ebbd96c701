"""The one logger entry point of vllm-omni: records print through vLLM's logging setup (same format, handlers
and env knobs), in the server and in every process it spawns.

vLLM configures only the `vllm` logger tree, and only in processes that call `configure_logging`, so records
of `vllm_omni.*` loggers would otherwise be dropped below WARNING. Our tree forwards every record to vLLM's
`vllm` logger instead, whatever handlers it has now. A ruff banned-api rule keeps `vllm.logger.init_logger`
out of the package so no module can bypass this.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from vllm.logger import configure_logging_if_needed
from vllm.logger import init_logger as _vllm_init_logger

if TYPE_CHECKING:
    from vllm.config.logging import LoggingConfig


class _ForwardToVllm(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _setup_root() -> None:
    root = logging.getLogger("vllm_omni")
    if any(isinstance(h, _ForwardToVllm) for h in root.handlers):
        return
    root.addHandler(_ForwardToVllm())
    root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    root.propagate = False


def init_logger(name: str):
    _setup_root()
    return _vllm_init_logger(name)


def configure_process_logging(config: LoggingConfig | None = None, process_name: str | None = None) -> None:
    """Set up logging in a process vLLM's CLI did not configure (a spawned worker): the server's `config`
    (None = vLLM's defaults from the environment), and `process_name` in every record's prefix, as vLLM's own
    `(EngineCore_DP0 pid=...)`, so interleaved lines in the server log say which stage and rank wrote them."""
    from vllm.config.logging import LoggingConfig
    from vllm.utils.system_utils import decorate_logs

    config = config or LoggingConfig()
    configure_logging_if_needed(config)
    if process_name is not None:
        decorate_logs(process_name)
    _setup_root()
    logging.getLogger("vllm_omni").setLevel(config.log_level)
