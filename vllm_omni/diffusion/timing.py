"""Per-stage durations that belong to the stage: CUDA work is asynchronous, so a stage's clock stops only
after the work it queued has finished (otherwise the denoise loop's tail is billed to the VAE decode)."""

from __future__ import annotations

import time

import torch


def elapsed_since(start: float, device: torch.device) -> float:
    """Seconds since `start` (a `time.perf_counter()` value), once `device` has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def synchronized_now(device: torch.device) -> float:
    """`time.perf_counter()` once `device` has finished its queued work: the start of a stage whose caller did
    not wait for the stage before it (a step-mode state's last denoise steps are still queued when it decodes)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
