"""Qwen-Image-2.1: Qwen3-VL prompt encoder -> single-stream block-causal DiT -> Qwen-Image-2.1 VAE, one stage."""

from vllm_omni.catalog.spec import DiffusionPipelineEntry, ModelSpec

SPEC = ModelSpec(
    family="qwen_image_21",
    description="Qwen/Qwen-Image-2.1 (native pipeline, matches diffusers; text K/V computed once per request)",
    diffusion_pipelines={
        "QwenImage21Pipeline": DiffusionPipelineEntry(
            "vllm_omni.models.qwen_image_21.pipeline:QwenImage21Pipeline",
            "image",
            input_modalities=frozenset({"text", "image"}),
            shape_rule="vllm_omni.models.qwen_image_21.shapes:shape_rule",
        )
    },
    tiny={"qwen-image-2.1": "vllm_omni.models.qwen_image_21.tiny:build_qwen_image_21"},
)
