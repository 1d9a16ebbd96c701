"""What each rank runs in the parallelism tests: a native pipeline from a tiny checkpoint, end to end.

Importable by name so the spawned ranks can unpickle the job functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.step_context import StepContext
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


def run_pipeline(model_dir: str, parallel: dict, prompt: dict, params: dict) -> dict[str, np.ndarray]:
    """Final latents and decoded output of one request, as float64 arrays."""
    from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner

    od_config = OmniDiffusionConfig(model=model_dir, parallel_config=DiffusionParallelConfig(**parallel))
    runner = DiffusionModelRunner(od_config, torch.device("cpu"))
    runner.load_model()
    pipe = runner.pipeline
    request = OmniDiffusionRequest(prompt, OmniDiffusionSamplingParams(**params), "r0")
    ctx = StepContext(od_config, request_ids=["r0"])
    with torch.inference_mode():
        state = pipe.prepare([request], ctx)
        pipe.denoise(state, ctx)
        latents = state.latents.clone()
        (out,) = pipe.finish(state, ctx)
    assert out.error is None, out.error
    return {"latents": latents.double().numpy(), "output": _as_array(out.output)}


def _as_array(output: Any) -> np.ndarray:
    if isinstance(output, dict):  # video pipelines
        output = output["video"]
    return np.asarray(output, dtype=np.float64)


def psnr(got: np.ndarray, want: np.ndarray) -> float:
    """PSNR against the peak of `want` (inf when equal)."""
    mse = float(np.mean((got - want) ** 2))
    peak = float(np.abs(want).max())
    return float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse)


def parallel_layout() -> dict[str, Any]:
    """What this rank's model sees: sequence-parallel size and whether its attention layers run sharded."""
    from vllm_omni.diffusion.distributed.parallel_state import get_diffusion_groups

    groups = get_diffusion_groups()
    return {name: getattr(groups, name).world_size for name in ("ulysses", "ring", "sp", "cfg")}


def attention_cases(seed: int) -> dict[str, Any]:
    """Sharded joint attention (text rear / front, GQA, MQA) vs whole-sequence SDPA on the same q/k/v, and the
    start-up error of a Ulysses degree the heads cannot take."""
    import torch.nn.functional as F

    from vllm_omni.diffusion.attention.layer import Attention
    from vllm_omni.diffusion.distributed.parallel_state import get_diffusion_groups
    from vllm_omni.diffusion.distributed.sequence import gather_sequence, shard_sequence

    torch.manual_seed(seed)
    batch, img, txt, heads, dim = 2, 8, 3, 4, 8
    errors = {}
    for kv_heads in (4, 2, 1):
        for front in (False, True):
            q = torch.randn(batch, img + txt, heads, dim)
            k, v = (torch.randn(batch, img + txt, kv_heads, dim) for _ in range(2))
            want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                  enable_gqa=kv_heads != heads).transpose(1, 2)
            if front:
                split = lambda t: (t[:, txt:], t[:, :txt])  # noqa: E731
                join = lambda s, j: torch.cat([j, s], 1)  # noqa: E731
            else:
                split = lambda t: (t[:, :t.shape[1] - txt], t[:, t.shape[1] - txt:])  # noqa: E731
                join = lambda s, j: torch.cat([s, j], 1)  # noqa: E731
            local = [join(shard_sequence(s), j) for s, j in map(split, (q, k, v))]
            try:
                layer = Attention(heads, dim, num_kv_heads=kv_heads)
            except ValueError as exc:
                errors[(kv_heads, front)] = str(exc)
                continue
            out_s, out_j = split(layer(*local, joint_len=txt, joint_front=front))
            got = join(gather_sequence(out_s), out_j)
            errors[(kv_heads, front)] = float((got - want).abs().max())
    try:
        Attention(get_diffusion_groups().ulysses.world_size * 2 + 1, dim)
        errors["bad_heads"] = None
    except ValueError as exc:
        errors["bad_heads"] = str(exc)
    return errors
