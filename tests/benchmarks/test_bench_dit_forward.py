"""The DiT forward benchmark's CPU smoke mode: builds tiny configs of every family it times, loads diffusers' weights
into ours by name mapping, times both and writes JSON. Pins that the harness itself works in CI (the GPU numbers
come from the same code) and that our transformers agree with diffusers on the same weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "diffusion"))


@pytest.mark.timeout(300)
def test_smoke_mode_writes_rows(tmp_path):
    import bench_dit_forward

    out = tmp_path / "res.json"
    models = ["flux", "qwen-image", "z-image", "flux2-klein", "qwen-image-2.1", "hunyuan-image-2.1"]
    result = bench_dit_forward.main(["--smoke", "--no-compile", "--models", *models, "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    rows = {(r["model"], r["variant"]): r for r in saved["rows"]}
    for model in models:
        ref, ours = rows[(model, "diffusers eager")], rows[(model, "ours eager (TORCH_SDPA)")]
        assert ref["ms_median"] > 0 and ours["ms_median"] > 0
        assert ours["psnr_vs_diffusers"] >= 40.0
    assert saved["env"]["torch"]
