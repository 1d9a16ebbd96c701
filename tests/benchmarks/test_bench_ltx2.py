"""The LTX-2 benchmark's CPU smoke mode on the tiny checkpoint: ours and diffusers' pipeline on shared modules,
one CFG step and the whole pipeline, JSON and PNG written. Pins that the harness the H200 numbers come from works
and that both sides computed the same clip (so the timings compare like with like)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "diffusion"))


@pytest.mark.timeout(300)
def test_smoke_mode_writes_rows(tmp_path):
    import bench_ltx2

    out, png = tmp_path / "res.json", tmp_path / "res.png"
    result = bench_ltx2.main(["--smoke", "--out", str(out), "--png", str(png)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"], default=str))
    step, pipe = saved["rows"]
    assert step["what"] == "CFG step" and step["diffusers_ms"] > 0 and step["ours_ms"] > 0
    assert pipe["what"] == "pipeline" and pipe["psnr_vs_diffusers"] >= 35.0 and pipe["audio_snr_vs_diffusers"] >= 40
    assert png.stat().st_size > 0
