"""The stage's attention backend reaches every attention layer of every native DiT (issue 12: Wan ignored it).

A counting backend (SDPA underneath) is registered under its own name, so a layer that ignored the stage's
`diffusion_attention_backend` would hold the platform default instead and count nothing. Wan goes through the
worker's model runner (the path `--diffusion-attention-backend` takes); Qwen-Image and FLUX through their
`from_pretrained`. A bad name fails at load, naming the flag.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni.catalog.tiny import build_tiny
from vllm_omni.diffusion.attention.backends.sdpa import TorchSDPABackend, TorchSDPAImpl
from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

COUNTING = "COUNTING_SDPA"


class CountingImpl(TorchSDPAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, query, key, value, attn_mask):
        self.calls += 1
        return super().forward(query, key, value, attn_mask)


class CountingBackend(TorchSDPABackend):
    name = COUNTING

    @classmethod
    def get_impl_cls(cls):
        return CountingImpl


@pytest.fixture
def counting_backend(monkeypatch):
    from vllm_omni.diffusion.attention import selector

    monkeypatch.setitem(selector._BACKENDS, COUNTING, f"{__name__}:CountingBackend")
    # Nothing may fall back to the env var: it names a backend that does not exist.
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "NOPE")


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert layers
    return layers


def calls(model: torch.nn.Module) -> int:
    return sum(layer.impl.calls for layer in attention_layers(model))


def request(prompt: str, **params) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(seed=0, **params), "r0")


@pytest.mark.parametrize("tiny", ["wan2.1-t2v", "wan2.2-t2v-a14b"])
def test_wan_runs_its_attention_through_the_stage_backend(dist_world, counting_backend, tiny):
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    od_config = OmniDiffusionConfig(model=str(build_tiny(tiny)), diffusion_attention_backend=COUNTING.lower())
    runner = DiffusionModelRunner(od_config, torch.device("cpu"))
    runner.load_model()
    experts = [m for m in (runner.pipeline.transformer, runner.pipeline.transformer_2) if m is not None]
    assert len(experts) == (2 if "a14b" in tiny else 1)
    for expert in experts:
        assert all(layer.attn_backend is CountingBackend for layer in attention_layers(expert))
    steps = 4
    [out] = runner.execute_model(DiffusionRequestBatch([request(
        "A cat.", height=32, width=48, num_frames=5, num_inference_steps=steps, max_sequence_length=16)]))
    assert out.error is None
    # Every forward runs each block's self- and cross-attention once (CFG rows share the forward).
    total = sum(calls(expert) for expert in experts)
    assert total == steps * 2 * experts[0].config.num_layers
    assert all(calls(expert) > 0 for expert in experts)  # A14B: both experts ran on the stage's backend


def test_qwen_image_runs_its_attention_through_the_stage_backend(dist_world, counting_backend):
    from vllm_omni.models.qwen_image.pipeline import QwenImagePipeline

    model_dir = build_tiny("qwen-image")
    pipe = QwenImagePipeline.from_pretrained(OmniDiffusionConfig(model=str(model_dir),
                                                                 diffusion_attention_backend=COUNTING),
                                             model_dir, torch.device("cpu"), torch.float32)
    assert all(layer.attn_backend is CountingBackend for layer in attention_layers(pipe.transformer))
    with torch.inference_mode():
        [out] = pipe.forward(DiffusionRequestBatch([request("a red cube", height=64, width=64,
                                                            num_inference_steps=2)]))
    assert out.error is None
    assert calls(pipe.transformer) >= 2 * len(pipe.transformer.transformer_blocks)


def test_flux_builds_its_attention_on_the_stage_backend(dist_world, counting_backend):
    from vllm_omni.models.flux.pipeline import FluxPipeline

    model_dir = build_tiny("flux")
    pipe = FluxPipeline.from_pretrained(OmniDiffusionConfig(model=str(model_dir), diffusion_attention_backend=COUNTING),
                                        model_dir, torch.device("cpu"), torch.float32)
    assert all(layer.attn_backend is CountingBackend for layer in attention_layers(pipe.transformer))


def test_unknown_backend_fails_at_load_naming_the_flag(dist_world):
    from vllm_omni.models.wan.pipeline import WanPipeline

    model_dir = build_tiny("wan2.1-t2v")
    # Refused as soon as the config is built (before any weight is read), naming the flag and the bad value.
    with pytest.raises(ValueError, match=r"--diffusion-attention-backend.*'NOPE'"):
        WanPipeline.from_pretrained(OmniDiffusionConfig(model=str(model_dir), diffusion_attention_backend="NOPE"),
                                    model_dir, torch.device("cpu"), torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="FLASH_ATTN is unavailable only without a GPU")
def test_unavailable_backend_fails_at_load_naming_the_flag(dist_world):
    from vllm_omni.models.wan.pipeline import WanPipeline

    model_dir = build_tiny("wan2.1-t2v")
    with pytest.raises(RuntimeError, match="FLASH_ATTN is not available.*--diffusion-attention-backend"):
        WanPipeline.from_pretrained(OmniDiffusionConfig(model=str(model_dir),
                                                        diffusion_attention_backend="FLASH_ATTN"),
                                    model_dir, torch.device("cpu"), torch.float32)
