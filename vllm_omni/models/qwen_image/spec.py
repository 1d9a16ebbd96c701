"""Qwen-Image and Qwen-Image-Edit: Qwen2.5-VL text encoder -> MMDiT -> VAE, one diffusion stage."""

from vllm_omni.catalog.spec import DiffusionPipelineEntry, ModelSpec

_SHAPES = "vllm_omni.models.qwen_image.shapes:shape_rule"

SPEC = ModelSpec(
    family="qwen_image",
    description="Qwen/Qwen-Image, Qwen/Qwen-Image-Edit (native pipelines, match diffusers)",
    diffusion_pipelines={
        "QwenImagePipeline": DiffusionPipelineEntry("vllm_omni.models.qwen_image.pipeline:QwenImagePipeline",
                                                    "image", max_prompt_tokens=1024, shape_rule=_SHAPES),
        "QwenImageEditPipeline": DiffusionPipelineEntry(
            "vllm_omni.models.qwen_image.pipeline_edit:QwenImageEditPipeline", "image",
            input_modalities=frozenset({"text", "image"}), max_prompt_tokens=1024,
            shape_rule=_SHAPES),
    },
    tiny={"qwen-image": "vllm_omni.models.qwen_image.tiny:build_qwen_image",
          "qwen-image-edit": "vllm_omni.models.qwen_image.tiny:build_qwen_image_edit"},
)
