"""Sequence parallel (Ulysses, ring, USP), CFG parallel and their products with TP, on 2 and 4 gloo ranks.

What it pins: for Qwen-Image, FLUX, Z-Image, FLUX.2 klein, Qwen-Image-2.1 (CFG and TP only: it refuses sequence
parallel), HunyuanImage-2.1 (its CFG/APG guider over 3 steps, prompt and negative of different lengths, glyph
tokens) and Wan (tiny checkpoints, fp32, 2 steps, CFG on) every parallel layout (the later families:
SHORT_LAYOUTS) gives the single-rank latents and decoded output (PSNR >= 60 dB); the sharded attention layer
equals whole-sequence attention with text at the rear (Qwen-Image) or front (FLUX), for MHA, GQA and MQA; a
Ulysses degree that does not divide the heads fails when the model is built, naming the flag. One spawn of 4
ranks runs every job (see parallel_harness.py), so the whole module costs two worlds' start-up.
"""

from __future__ import annotations

import pytest
from parallel_harness import run_jobs
from parallel_jobs import attention_cases, parallel_layout, psnr, run_pipeline

from vllm_omni.diffusion.data import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.parallel_state import group_ranks

LAYOUTS = {
    "ulysses2": {"ulysses_degree": 2},
    "ring2": {"ring_degree": 2},
    "usp2x2": {"ulysses_degree": 2, "ring_degree": 2},
    "cfg2": {"cfg_parallel_size": 2},
    "cfg2_ulysses2": {"cfg_parallel_size": 2, "ulysses_degree": 2},
    "tp2_ulysses2": {"tensor_parallel_size": 2, "ulysses_degree": 2},
}
NAMED_ONLY = {"cfg2_tp2": {"cfg_parallel_size": 2, "tensor_parallel_size": 2}}
"""Layouts run only by the families that name them in SHORT_LAYOUTS."""
CFG = {"prompt": "a red cube on a table", "negative_prompt": "blurry"}
MODELS = {
    "qwen-image": (CFG, dict(height=64, width=64, num_inference_steps=2, seed=0, true_cfg_scale=4.0,
                             output_type="np")),
    "flux": (CFG, dict(height=64, width=64, num_inference_steps=2, seed=0, true_cfg_scale=4.0, output_type="np")),
    "z-image-turbo": (CFG, dict(height=64, width=64, num_inference_steps=2, seed=0, guidance_scale=4.0,
                                output_type="np")),
    "flux2-klein-base": (CFG, dict(height=64, width=64, num_inference_steps=2, seed=0, guidance_scale=4.0,
                                   max_sequence_length=32, output_type="np")),
    "qwen-image-2.1": (CFG, dict(height=64, width=64, num_inference_steps=2, seed=0, true_cfg_scale=4.0,
                                 output_type="np")),
    "hunyuan-image-2.1": ({"prompt": 'a red cube on a table "HI"', "negative_prompt": "blurry"},
                          dict(height=64, width=64, num_inference_steps=3, seed=0, output_type="np")),
    "wan2.1-t2v": ({"prompt": "a cat walks", "negative_prompt": "blurry"},
                   dict(height=32, width=32, num_frames=5, num_inference_steps=2, seed=0, max_sequence_length=16)),
}
SHORT_LAYOUTS = {"z-image-turbo": ("ulysses2", "cfg2_ulysses2", "tp2_ulysses2"),
                 "flux2-klein-base": ("ulysses2", "cfg2_ulysses2", "tp2_ulysses2"),
                 "qwen-image-2.1": ("cfg2", "cfg2_tp2"),
                 "hunyuan-image-2.1": ("cfg2_ulysses2", "tp2_ulysses2")}
"""Families added later run the layouts that cover their own code (image-token sharding, the CFG split, TP
sharding); ring and USP differ only inside the shared attention layer, checked below for every layout."""
CASES = [(model, layout) for model in MODELS for layout in SHORT_LAYOUTS.get(model, LAYOUTS)]


@pytest.fixture(scope="module")
def results():
    from vllm_omni.catalog.tiny import build_tiny

    dirs = {name: str(build_tiny(name, num_heads=4)) for name in MODELS}  # 4 heads: TP 2 x Ulysses 2
    jobs, keys = [], []
    for name, (prompt, params) in MODELS.items():
        for layout in ("single", *SHORT_LAYOUTS.get(name, LAYOUTS)):
            parallel = {**LAYOUTS, **NAMED_ONLY}.get(layout, {})
            jobs.append((parallel, run_pipeline, (dirs[name], parallel, prompt, params)))
            keys.append((name, layout))
    for layout in ("ulysses2", "ring2", "usp2x2"):
        jobs += [(LAYOUTS[layout], attention_cases, (0,)), (LAYOUTS[layout], parallel_layout, ())]
        keys += [("attention", layout), ("groups", layout)]
    return dict(zip(keys, run_jobs(jobs), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("model, layout", CASES)
def test_parallel_layout_matches_single_rank(results, model, layout):
    want, got = results[(model, "single")], results[(model, layout)]
    assert want["output"].std() > 0
    assert psnr(got["latents"], want["latents"]) >= 60.0
    assert psnr(got["output"], want["output"]) >= 60.0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ulysses2", "ring2", "usp2x2"])
def test_sharded_attention_equals_whole_sequence_attention(results, layout):
    cases = dict(results[("attention", layout)])
    bad_heads = cases.pop("bad_heads")
    ulysses = LAYOUTS[layout].get("ulysses_degree", 1) > 1
    assert ("--ulysses-degree" in bad_heads) if ulysses else bad_heads is None  # ring takes any head count
    for (kv_heads, front), err in cases.items():
        if ulysses and kv_heads == 1:  # one K/V head cannot be split over 2 Ulysses ranks
            assert "--ulysses-degree 2 does not divide the 1 attention heads" in err
        else:
            assert err < 1e-5, (kv_heads, front, err)
    groups = results[("groups", layout)]
    assert groups["sp"] == groups["ulysses"] * groups["ring"] == DiffusionParallelConfig(**LAYOUTS[layout]).world_size


def test_rank_layout_is_tp_innermost_then_ulysses_ring_cfg():
    ranks = group_ranks(DiffusionParallelConfig(tensor_parallel_size=2, ulysses_degree=2, ring_degree=1,
                                                cfg_parallel_size=2))
    assert ranks["ulysses"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ranks["cfg"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ranks["ring"] == [[r] for r in range(8)]
    usp = group_ranks(DiffusionParallelConfig(ulysses_degree=2, ring_degree=2))
    assert usp["ulysses"] == [[0, 1], [2, 3]] and usp["ring"] == [[0, 2], [1, 3]] and usp["sp"] == [[0, 1, 2, 3]]
