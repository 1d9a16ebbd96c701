"""Two stages from YAML: an LLM writes the image prompt (AR stage on vLLM), Qwen-Image draws it (DIFFUSION stage).

    .venv/bin/python examples/offline_inference/multi_stage_prompt_to_image.py        # tiny models, CPU
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm import SamplingParams

from vllm_omni import Omni, OmniDiffusionSamplingParams

PIPELINE = Path(__file__).parent / "pipelines" / "prompt_rewriter_to_qwen_image.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny/qwen2", help="the LLM of stage 0")
    parser.add_argument("--pipeline", default=str(PIPELINE))
    parser.add_argument("--deploy-config", default="shm_connector")
    parser.add_argument("--prompt", default="Describe a cat on a red chair")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="prompt_to_image.png")
    args = parser.parse_args()

    with Omni(args.model, pipeline_config=args.pipeline, deploy_config=args.deploy_config,
              gpu_memory_utilization=0.15) as omni:
        print(f"stages: {omni.stage_types}, outputs: {omni.output_modalities}")
        (out,) = omni.generate(args.prompt, [
            SamplingParams(max_tokens=16, temperature=0.0),
            OmniDiffusionSamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps, seed=0),
        ])
    if out.error:
        raise SystemExit(f"request failed: {out.error}")
    out.images[0].save(args.out)
    print(f"saved {args.out}; stage durations: { {k: round(v, 3) for k, v in out.stage_durations.items()} }")


if __name__ == "__main__":
    main()
