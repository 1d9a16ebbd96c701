"""Wan 2.1 / 2.2: UMT5 text encoder -> video DiT (one or two experts) -> video VAE, one diffusion stage."""

from vllm_omni.catalog.spec import DiffusionPipelineEntry, ModelSpec

_SHAPES = "vllm_omni.models.wan.shapes:shape_rule"

SPEC = ModelSpec(
    family="wan",
    description="Wan-AI Wan2.1 T2V/I2V, Wan2.2 A14B and TI2V-5B (native pipelines, match diffusers)",
    diffusion_pipelines={
        "WanPipeline": DiffusionPipelineEntry("vllm_omni.models.wan.pipeline:WanPipeline", "video",
                                              max_prompt_tokens=512, shape_rule=_SHAPES),
        "WanImageToVideoPipeline": DiffusionPipelineEntry(
            "vllm_omni.models.wan.pipeline_i2v:WanImageToVideoPipeline", "video",
            input_modalities=frozenset({"text", "image"}), max_prompt_tokens=512,
            shape_rule=_SHAPES),
    },
    tiny={"wan2.1-t2v": "vllm_omni.models.wan.tiny:build_wan21_t2v",
          "wan2.1-i2v": "vllm_omni.models.wan.tiny:build_wan21_i2v",
          "wan2.2-t2v-a14b": "vllm_omni.models.wan.tiny:build_wan22_t2v_a14b",
          "wan2.2-i2v-a14b": "vllm_omni.models.wan.tiny:build_wan22_i2v_a14b",
          "wan2.2-ti2v-5b": "vllm_omni.models.wan.tiny:build_wan22_ti2v_5b"},
)
