"""Causal LMs vLLM serves as they are: one AR stage on vLLM's EngineCore (no topology of ours).

The family also holds the generic stage-input processors any AR stage can feed another stage with.
"""

from vllm_omni.catalog.spec import ModelSpec

SPEC = ModelSpec(
    family="llm",
    description="any causal LM vLLM supports (one AR stage)",
    stage_input_processors={"text_to_prompt": "vllm_omni.models.llm.edges:text_to_prompt",
                            "token_ids_to_prompt": "vllm_omni.models.llm.edges:token_ids_to_prompt"},
    tiny={"qwen2": "vllm_omni.models.llm.tiny:build_qwen2", "qwen3": "vllm_omni.models.llm.tiny:build_qwen3"},
)
