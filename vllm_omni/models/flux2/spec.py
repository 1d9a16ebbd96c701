"""FLUX.2 [dev] (Mistral-3 text encoder) and [klein] (Qwen3): -> FLUX.2 MMDiT -> FLUX.2 VAE, one diffusion stage."""

from vllm_omni.catalog.spec import DiffusionPipelineEntry, ModelSpec

SPEC = ModelSpec(
    family="flux2",
    description="black-forest-labs/FLUX.2-dev, FLUX.2-klein-4B / -9B and -base (native pipelines, match diffusers)",
    diffusion_pipelines={
        "Flux2KleinPipeline": DiffusionPipelineEntry(
            "vllm_omni.models.flux2.pipeline:Flux2KleinPipeline",
            "image",
            input_modalities=frozenset({"text", "image"}),
            max_prompt_tokens=512,
            shape_rule="vllm_omni.models.flux2.shapes:shape_rule",
        ),
        "Flux2Pipeline": DiffusionPipelineEntry(
            "vllm_omni.models.flux2.pipeline_dev:Flux2Pipeline",
            "image",
            input_modalities=frozenset({"text", "image"}),
            max_prompt_tokens=512,
            shape_rule="vllm_omni.models.flux2.shapes:shape_rule",
        ),
    },
    tiny={
        "flux2-dev": "vllm_omni.models.flux2.tiny:build_flux2_dev",
        "flux2-klein": "vllm_omni.models.flux2.tiny:build_flux2_klein",
        "flux2-klein-base": "vllm_omni.models.flux2.tiny:build_flux2_klein_base",
    },
)
