"""LTX-2: Gemma3 text encoder -> joint audio-video DiT -> video VAE + audio VAE / vocoder, one diffusion stage
whose output is a clip with its soundtrack."""

from vllm_omni.catalog.spec import DiffusionPipelineEntry, ModelSpec

SPEC = ModelSpec(
    family="ltx2",
    description="Lightricks LTX-2 text/image-to-video with audio (native pipeline, matches diffusers)",
    diffusion_pipelines={
        "LTX2Pipeline": DiffusionPipelineEntry(
            "vllm_omni.models.ltx2.pipeline:LTX2Pipeline",
            "video",
            input_modalities=frozenset({"text", "image"}),
            max_prompt_tokens=1024,
            shape_rule="vllm_omni.models.ltx2.shapes:shape_rule",
        ),
    },
    tiny={"ltx2": "vllm_omni.models.ltx2.tiny:build_ltx2"},
)
