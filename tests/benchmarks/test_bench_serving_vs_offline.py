"""The one-run serving-vs-offline benchmark and the config-only checkpoints it runs on.

Pins: `write_config_only_checkpoint.py` writes the real repo layout without a single weight file, with the
published component sizes (counted on the meta device: Qwen-Image 20.4B + Qwen2.5-VL 8.3B, FLUX.1-dev 11.9B +
T5-XXL 4.8B + CLIP-L 0.12B) and token ids below the real vocab sizes; `--smoke` of the benchmark runs both paths
for real (offline `Omni`, then a `serve --omni` subprocess under load), writes JSON with both results, and
stops the server cleanly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "diffusion"))

SIZES_B = {  # subfolder -> (class, billions of parameters)
    "qwen-image": {"transformer": ("diffusers:QwenImageTransformer2DModel", 20.43),
                   "text_encoder": ("transformers:Qwen2_5_VLForConditionalGeneration", 8.29),
                   "vae": ("diffusers:AutoencoderKLQwenImage", 0.127)},
    "flux": {"transformer": ("diffusers:FluxTransformer2DModel", 11.90),
             "text_encoder": ("transformers:CLIPTextModel", 0.123),
             "text_encoder_2": ("transformers:T5EncoderModel", 4.76),
             "vae": ("diffusers:AutoencoderKL", 0.084)},
}


def _params_on_meta(class_path: str, folder: Path) -> float:
    import importlib

    library, _, name = class_path.partition(":")
    cls = getattr(importlib.import_module(library), name)
    with torch.device("meta"):
        if library == "transformers":
            model = cls._from_config(cls.config_class.from_pretrained(folder))
        else:
            model = cls.from_config(cls.load_config(folder))
    return sum(p.numel() for p in model.parameters()) / 1e9


@pytest.mark.parametrize("model", ["qwen-image", "flux"])
def test_real_size_checkpoint_has_configs_only(tmp_path, model):
    import write_config_only_checkpoint as writer
    from transformers import AutoTokenizer

    out = writer.main(["--model", model, "--out", str(tmp_path / model)])
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert "model_index.json" in files and "scheduler/scheduler_config.json" in files
    assert not [f for f in files if f.endswith((".safetensors", ".bin", ".index.json"))]
    for subfolder, (class_path, billions) in SIZES_B[model].items():
        assert _params_on_meta(class_path, out / subfolder) == pytest.approx(billions, rel=0.01), subfolder
    for tokenizer, encoder in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")):
        if (out / tokenizer).is_dir():
            config = json.loads((out / encoder / "config.json").read_text())
            vocab = config.get("text_config", config)["vocab_size"]
            assert max(AutoTokenizer.from_pretrained(out / tokenizer).get_vocab().values()) < vocab


def test_tiny_checkpoint_keeps_tiny_sizes_and_refuses_foreign_dirs(tmp_path):
    import write_config_only_checkpoint as writer

    out = writer.write_checkpoint("flux", tmp_path / "flux", tiny=True)
    assert json.loads((out / "transformer" / "config.json").read_text())["num_layers"] < 19
    assert not list(out.rglob("*.safetensors"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a checkpoint directory"):
        writer.write_checkpoint("flux", tmp_path / "mine")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_smoke_runs_offline_then_serving(tmp_path):
    import bench_serving_vs_offline as bench

    from tests.entrypoints.leak_checks import shm_segments, wait_until_clean

    shm_before = shm_segments()
    out = tmp_path / "serve.json"
    result = bench.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    offline, serving = saved["offline"], saved["serving"]
    assert offline["images"] == 4 and offline["images_per_s"] > 0
    assert serving["completed"] == 4 and serving["failed"] == 0, serving["errors"]
    assert serving["clean_shutdown"] and "--load-format" in serving["command"]
    assert {"diffusion.denoise", "diffusion.vae_decode"} <= set(serving["stage_durations_mean_s"])
    assert saved["serving_over_offline"] == pytest.approx(serving["images_per_s"] / offline["images_per_s"])
    assert saved["env"]["torch"] and result["args"]["load_format"] == "dummy"
    assert out.with_suffix(".server.log").stat().st_size > 0
    assert wait_until_clean(shm_before) == ([], set())  # neither engine nor server left a process or segment
