"""HunyuanImage-2.1: Qwen2.5-VL + ByT5 encoders -> dual/single-stream MMDiT -> 32x VAE, one diffusion stage."""

from vllm_omni.catalog.spec import DiffusionPipelineEntry, ModelSpec

SPEC = ModelSpec(
    family="hunyuan_image_21",
    description="tencent/HunyuanImage-2.1 and its Distilled variant, Diffusers layout (native pipeline, matches "
                "diffusers)",
    diffusion_pipelines={
        "HunyuanImagePipeline": DiffusionPipelineEntry(
            "vllm_omni.models.hunyuan_image_21.pipeline:HunyuanImagePipeline",
            "image",
            # diffusers truncates the templated prompt at 1000 + 34 tokens: 34 system, 3 user header, 1 end.
            max_prompt_tokens=996,
            shape_rule="vllm_omni.models.hunyuan_image_21.shapes:shape_rule",
        )
    },
    tiny={
        "hunyuan-image-2.1": "vllm_omni.models.hunyuan_image_21.tiny:build_hunyuan_image_21",
        "hunyuan-image-2.1-distilled": "vllm_omni.models.hunyuan_image_21.tiny:build_hunyuan_image_21_distilled",
    },
)
