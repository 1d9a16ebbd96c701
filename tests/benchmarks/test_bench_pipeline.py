"""The pipeline benchmark's CPU smoke mode for the families it times through one generic builder (Z-Image,
FLUX.2 klein, Qwen-Image-2.1): our pipeline and diffusers' on the tiny checkpoints' encoders and VAE, the same
transformer weights, one row each and the same image. Pins that the harness the H200 runs works."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "diffusion"))


@pytest.mark.timeout(600)
def test_smoke_mode_times_both_pipelines_on_the_same_image(tmp_path):
    import bench_pipeline

    models = ["z-image", "flux2-klein", "qwen-image-2.1"]
    out = tmp_path / "res.json"
    bench_pipeline.main(["--smoke", "--models", *models, "--out", str(out)])
    rows = {(r["model"], r.get("pipeline")): r for r in json.loads(out.read_text())["rows"]}
    for model in models:
        assert "error" not in rows.get((model, None), {}), rows[(model, None)]
        ref, ours = rows[(model, "diffusers")], rows[(model, "ours eager")]
        assert ref["s"] > 0 and ours["s"] > 0 and ours["steps"] == 2
        assert ours["psnr_vs_diffusers"] >= 40.0
