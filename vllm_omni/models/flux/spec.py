"""FLUX.1: CLIP + T5 text encoders -> MMDiT (double + single blocks) -> VAE, one diffusion stage."""

from vllm_omni.catalog.spec import DiffusionPipelineEntry, ModelSpec

SPEC = ModelSpec(
    family="flux",
    description="black-forest-labs/FLUX.1-dev (native pipeline, matches diffusers)",
    diffusion_pipelines={"FluxPipeline": DiffusionPipelineEntry(
        "vllm_omni.models.flux.pipeline:FluxPipeline", "image", max_prompt_tokens=512, prompt_tokenizer="tokenizer_2",
        shape_rule="vllm_omni.models.flux.shapes:shape_rule")},
    tiny={"flux": "vllm_omni.models.flux.tiny:build_flux"},
)
