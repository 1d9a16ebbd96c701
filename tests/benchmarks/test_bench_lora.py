"""The LoRA benchmark's CPU smoke mode: tiny Qwen-Image, adapters loaded through the serving path, every variant
timed and written (JSON, PNG). Pins that the harness works in CI; the H200 numbers come from the same code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "diffusion"))


@pytest.mark.timeout(300)
def test_smoke_mode_writes_rows(tmp_path):
    import bench_lora

    result = bench_lora.main(["--smoke", "--out", str(tmp_path / "res.json"), "--png", str(tmp_path / "res.png")])
    saved = json.loads((tmp_path / "res.json").read_text())
    assert saved["rows"] == result["rows"]
    assert [r["variant"] for r in saved["rows"]] == ["no LoRA", "hooks, no adapter", "1 adapter", "4 adapters"]
    assert all(r["ms_median"] > 0 for r in saved["rows"]) and saved["rows"][0]["x_no_lora"] == 1.0
    assert (tmp_path / "res.png").stat().st_size > 0
