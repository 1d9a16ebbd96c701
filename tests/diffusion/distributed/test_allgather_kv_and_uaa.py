"""AllGather-KV sequence parallel and Ulysses `advanced_uaa` on 2 and 4 gloo ranks.

What it pins (seed §1.12 / §2.12): sharded joint attention (text at the front or the rear; MHA, GQA, MQA)
equals whole-sequence attention with AllGather-KV 2, with Ulysses 2 in `advanced_uaa` mode on head counts 2
does not divide (3 heads; 6 query heads over 3 K/V heads; MQA with 3 query heads), with both (Ulysses 2 uaa x
AllGather-KV 2), and with uaa + ring 2 where no K/V padding is needed (4 heads); uaa + ring with K/V heads the
Ulysses degree does not divide (8 query heads, 1 K/V head, Ulysses 2, ring 2) is refused when the layer is built,
with "does not support K/V head padding"; strict mode refuses 3 heads over Ulysses 2 naming --ulysses-mode; the
tiny Qwen-Image pipeline with AllGather-KV 2 gives the single-rank output (PSNR >= 60 dB, fp32); AllGather-KV
with a ring degree is refused where the config is resolved, naming the flag.
"""

from __future__ import annotations

import pytest
from kv_gather_jobs import sharded_attention_errors
from parallel_harness import run_jobs
from parallel_jobs import psnr, run_pipeline

from vllm_omni.diffusion.data import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.parallel_state import group_ranks
from vllm_omni.errors import OmniClientError

MHA_GQA_MQA = [(4, kv, front) for kv in (4, 2, 1) for front in (False, True)]
UNEVEN = [(3, 3, False), (3, 3, True), (6, 3, False), (3, 1, True)]
LAYOUTS = {
    "allgather2": ({"allgather_degree": 2}, MHA_GQA_MQA),
    "uaa2": ({"ulysses_degree": 2, "ulysses_mode": "advanced_uaa"}, UNEVEN + MHA_GQA_MQA[:2]),
    "strict2": ({"ulysses_degree": 2}, [(3, 3, False)]),
    "uaa2_allgather2": ({"ulysses_degree": 2, "allgather_degree": 2, "ulysses_mode": "advanced_uaa"},
                        UNEVEN + [(4, 2, True)]),
    "uaa2_ring2": ({"ulysses_degree": 2, "ring_degree": 2, "ulysses_mode": "advanced_uaa"},
                   [(4, 4, False), (4, 2, True), (8, 1, False)]),
}
PROMPT = {"prompt": "a red cube", "negative_prompt": "blurry"}
PARAMS = dict(height=64, width=64, num_inference_steps=2, seed=0, true_cfg_scale=4.0, output_type="np")


@pytest.fixture(scope="module")
def results():
    from vllm_omni.catalog.tiny import build_tiny

    model = str(build_tiny("qwen-image"))
    jobs = [(parallel, sharded_attention_errors, (cases,)) for parallel, cases in LAYOUTS.values()]
    jobs += [({}, run_pipeline, (model, {}, PROMPT, PARAMS)),
             ({"allgather_degree": 2}, run_pipeline, (model, {"allgather_degree": 2}, PROMPT, PARAMS))]
    out = run_jobs(jobs)
    return dict(zip(LAYOUTS, out, strict=False)), out[-2], out[-1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["allgather2", "uaa2", "uaa2_allgather2"])
def test_sharded_attention_equals_whole_sequence(results, layout):
    errors = results[0][layout]
    assert set(errors) == set(LAYOUTS[layout][1])
    for case, error in errors.items():
        assert isinstance(error, float) and error < 1e-5, (case, error)


@pytest.mark.slow
def test_uaa_with_ring_pads_no_kv_heads(results):
    errors = results[0]["uaa2_ring2"]
    assert errors[(4, 4, False)] < 1e-5 and errors[(4, 2, True)] < 1e-5
    assert "does not support K/V head padding" in errors[(8, 1, False)]
    assert "--ulysses-mode advanced_uaa" in errors[(8, 1, False)]


@pytest.mark.slow
def test_strict_ulysses_refuses_heads_it_does_not_divide(results):
    message = results[0]["strict2"][(3, 3, False)]
    assert "--ulysses-degree 2 does not divide" in message and "--ulysses-mode advanced_uaa" in message


@pytest.mark.slow
def test_pipeline_with_allgather_kv_matches_single_rank(results):
    _, single, gathered = results
    assert single["output"].std() > 0
    assert psnr(gathered["latents"], single["latents"]) >= 60.0
    assert psnr(gathered["output"], single["output"]) >= 60.0


def test_allgather_layout_and_refusals():
    config = DiffusionParallelConfig(allgather_degree=2, ulysses_degree=2)
    assert config.sequence_parallel_size == config.world_size == 4
    ranks = group_ranks(config)
    assert ranks["ulysses"] == [[0, 1], [2, 3]] and ranks["allgather"] == [[0, 2], [1, 3]]
    assert ranks["sp"] == [[0, 1, 2, 3]] and ranks["ring"] == [[r] for r in range(4)]
    with pytest.raises(OmniClientError, match="--allgather-degree") as info:
        DiffusionParallelConfig(allgather_degree=2, ring_degree=2)
    assert info.value.param == "allgather_degree"
    with pytest.raises(OmniClientError, match="--ulysses-mode") as info:
        DiffusionParallelConfig(ulysses_degree=2, ulysses_mode="loose")
    assert info.value.param == "ulysses_mode"
    with pytest.raises(OmniClientError, match="ulysses_degree x ring_degree x allgather_degree"):
        DiffusionParallelConfig(sequence_parallel_size=2, allgather_degree=2, ulysses_degree=2)
