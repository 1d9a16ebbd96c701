"""What a model served by `vllm serve MODEL --omni` makes, as one word, so tools/run_default.sh prints the
requests that model answers: `image` / `video` (a diffusion pipeline's output), `chat-audio` (an AR-first
topology with a generation stage, e.g. Qwen3-Omni) or `chat`. It decides the way the server does
(`pipeline_for_model`, the model registry); a model that cannot be resolved prints the one-line error and exits 1.
    python tools/model_outputs.py tiny/qwen2
"""

from __future__ import annotations

import sys


def main(model: str) -> str:
    from vllm_omni.catalog.registry import MODEL_REGISTRY
    from vllm_omni.catalog.tiny import resolve_model
    from vllm_omni.config.omni_config import _read_json, pipeline_for_model
    from vllm_omni.config.stage_kind import StageKind

    path = resolve_model(model)
    index = _read_json(path, "model_index.json")
    if index is not None:
        return MODEL_REGISTRY.output_modality(index.get("_class_name", ""))
    kinds = {stage.execution_type for stage in pipeline_for_model(path).stages}
    return "chat-audio" if StageKind.GENERATION in kinds else "chat"


if __name__ == "__main__":
    from vllm_omni.errors import OmniClientError

    try:
        print(main(sys.argv[1]))
    except OmniClientError as exc:
        raise SystemExit(str(exc)) from None
