"""`load_format="dummy"`: diffusion models run from config files alone (real model sizes without weight files).

Pins: a config-only copy of the tiny Qwen-Image / FLUX checkpoints serves finite images of the requested size
through `Omni`; every parameter of every pipeline (native and diffusers adapter) is filled with the dummy values;
`auto` on the same directory fails before loading, naming the folders without weights; an unknown value names
`load_format`; a hub model in dummy mode fetches no weights.
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_omni.catalog.resolution import INDEX_FILES, WEIGHT_FILE_PATTERNS
from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.model_loader.dummy import DUMMY_HIGH, DUMMY_LOW

PIPELINES = {"qwen-image": "QwenImagePipeline", "qwen-image-edit": "QwenImageEditPipeline", "flux": "FluxPipeline",
             "wan2.1-t2v": "WanPipeline", "wan2.1-i2v": "WanImageToVideoPipeline",
             "hunyuan-image-2.1": "HunyuanImagePipeline"}


def config_only_copy(name: str, dst: Path) -> Path:
    """The tiny checkpoint's layout minus every weight file and weight index."""

    def weights(_: str, names: list[str]) -> list[str]:
        return [n for n in names if n in INDEX_FILES or any(fnmatch.fnmatch(n, p) for p in WEIGHT_FILE_PATTERNS)]

    shutil.copytree(build_tiny(name), dst, ignore=weights)
    return dst


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("config_only")
    return {name: config_only_copy(name, root / name) for name in PIPELINES}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen-image", "flux"])
def test_omni_serves_config_only_checkpoint(config_dirs, name):
    from vllm_omni import Omni, OmniDiffusionSamplingParams

    assert not list(config_dirs[name].rglob("*.safetensors"))
    params = OmniDiffusionSamplingParams(height=64, width=96, num_inference_steps=2, seed=0)
    with Omni(str(config_dirs[name]), load_format="dummy") as omni:
        (out,) = omni.generate("a lighthouse at dusk", params, use_tqdm=False)
    assert out.ok, out.error
    image = np.asarray(out.images[0])
    assert image.shape == (64, 96, 3)
    # Weights of +-1e-3 decode to about 0, i.e. mid-grey; a NaN anywhere would turn pixels to 0.
    assert 100 <= image.min() <= image.max() <= 155


@pytest.mark.parametrize(("name", "adapter"), [(name, False) for name in PIPELINES] + [
    # diffusers' QwenImageEditPipeline needs torchvision for its processor, which this environment lacks.
    (name, True) for name in PIPELINES if name != "qwen-image-edit"])
def test_every_parameter_gets_dummy_values(config_dirs, dist_world, name, adapter):
    from vllm_omni.catalog.registry import MODEL_REGISTRY

    cls = MODEL_REGISTRY.load_pipeline_class(PIPELINES[name], adapter)
    od_config = OmniDiffusionConfig(model=str(config_dirs[name]), load_format="dummy")
    pipeline = cls.from_pretrained(od_config, config_dirs[name], torch.device("cpu"), torch.float32)
    owner = pipeline.pipe if adapter else pipeline
    modules = [m for m in [owner, *vars(owner).values()] if isinstance(m, torch.nn.Module)]
    params = [p for m in modules for p in m.parameters() if p.is_floating_point() and p.numel() > 0]
    assert len(params) > 100
    assert all(bool(((p >= DUMMY_LOW) & (p <= DUMMY_HIGH)).all()) for p in params)  # none left at its init
    assert sum(float(p.detach().float().std()) > 0 for p in params if p.numel() > 1) > 0.9 * len(params)  # random


def test_auto_without_weights_names_the_empty_folders(config_dirs):
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

    with pytest.raises(FileNotFoundError) as info:
        DiffusionEngine(OmniDiffusionConfig(model=str(config_dirs["flux"])))
    message = str(info.value)
    assert "no weight files" in message and "load_format='dummy'" in message
    for folder in ("text_encoder", "text_encoder_2", "transformer", "vae"):
        assert f"'{folder}'" in message
    assert "'scheduler'" not in message and "'tokenizer'" not in message


def test_unknown_load_format_names_the_field():
    with pytest.raises(ValueError, match="load_format must be one of \\['auto', 'dummy'\\], got 'safetensors'"):
        OmniDiffusionConfig.from_kwargs(model="m", load_format="safetensors")


def test_hub_model_in_dummy_mode_fetches_no_weights(tmp_path, monkeypatch):
    import huggingface_hub

    from vllm_omni.catalog.resolution import resolve_model_dir

    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None):
        calls.append((allow_patterns, ignore_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_dir("org/model", with_weights=False) == tmp_path
    assert calls == [(None, list(WEIGHT_FILE_PATTERNS))]
