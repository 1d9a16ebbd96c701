"""Loggers for vllm-omni that print through vLLM's logging setup (same format, handlers and env knobs).

vLLM configures only the `vllm` logger tree, so records of `vllm_omni.*` loggers would otherwise be dropped
below WARNING. Our tree forwards every record to vLLM's root logger instead, whatever handlers it has now.
"""

from __future__ import annotations

import logging
import os

from vllm.logger import init_logger as _vllm_init_logger


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
