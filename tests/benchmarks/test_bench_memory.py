"""The memory benchmark's CPU mode (`--device cpu --tiny`): every variant (bf16, fp8, eager, offload) runs through
the worker's loader and is written (JSON, PNG). Pins that the harness works in CI; the H200 numbers come from the
same code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "diffusion"))


@pytest.mark.timeout(600)
def test_cpu_tiny_mode_writes_every_variant(tmp_path):
    import bench_memory

    result = bench_memory.main(
        ["--device", "cpu", "--tiny", "--out", str(tmp_path / "r.json"), "--png", str(tmp_path / "r.png")]
    )
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["rows"] == result["rows"]
    by = {row["variant"]: row for row in saved["rows"]}
    assert list(by) == ["bf16", "fp8", "bf16 eager", "offload"]
    assert all(row["step_ms"] > 0 for row in by.values())
    assert by["fp8"]["psnr_vs_bf16_db"] > 20 and by["fp8"]["x_bf16_memory"] < 1.0
    offload = by["offload"]
    assert offload["streamed_gb_per_step"] > 0 and offload["bound_ms"] > 0 and offload["psnr_vs_eager_db"] >= 60
    assert offload["transformer_bytes"] < by["bf16 eager"]["transformer_bytes"]
    assert (tmp_path / "r.png").stat().st_size > 0
