"""Z-Image: Qwen3 text encoder -> single-stream DiT -> FLUX VAE, one diffusion stage."""

from vllm_omni.catalog.spec import DiffusionPipelineEntry, ModelSpec

SPEC = ModelSpec(
    family="z_image",
    description="Tongyi-MAI/Z-Image-Turbo, Tongyi-MAI/Z-Image (native pipeline, matches diffusers)",
    diffusion_pipelines={
        "ZImagePipeline": DiffusionPipelineEntry(
            "vllm_omni.models.z_image.pipeline:ZImagePipeline",
            "image",
            max_prompt_tokens=512,
            shape_rule="vllm_omni.models.z_image.shapes:shape_rule",
        )
    },
    tiny={"z-image-turbo": "vllm_omni.models.z_image.tiny:build_z_image_turbo"},
)
