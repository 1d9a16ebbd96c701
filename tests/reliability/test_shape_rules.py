"""Sizes a pipeline cannot make are refused in the API process, on every route that takes a size.

Why it matters: D18 — `POST /v1/videos` with `size: "65x65"` answered 200 `queued` and the job then `failed`,
because Wan's multiple-of-16 check lived only in the worker. What it pins: each family's `ShapeRule` comes from
the checkpoint's configs alone (no pipeline loaded), and images, edits, chat, videos (JSON and multipart),
/sync and the video WebSocket all answer a 400 naming the field with nothing sent to the engine.
"""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.fake_engine import FakeOmni
from tests.reliability.conftest import assert_client_error, make_client, png
from vllm_omni.catalog.registry import MODEL_REGISTRY
from vllm_omni.catalog.shapes import ShapeRule
from vllm_omni.catalog.spec import import_target
from vllm_omni.catalog.tiny import build_tiny


@pytest.mark.parametrize("tiny,class_name,multiple,min_size,frame_stride", [
    ("qwen-image", "QwenImagePipeline", 16, 16, None),
    ("flux", "FluxPipeline", 1, 16, None),
    ("wan2.1-t2v", "WanPipeline", 16, 16, 4),
    ("wan2.2-ti2v-5b", "WanPipeline", 32, 32, 4),
    ("ltx2", "LTX2Pipeline", 32, 32, 2),  # the tiny VAE's one spatio-temporal doubling; diffusers' floor of 32
])
def test_rule_from_the_checkpoint_configs(tiny, class_name, multiple, min_size, frame_stride):
    rule = import_target(MODEL_REGISTRY.diffusion_entry(class_name).shape_rule)(build_tiny(tiny))
    assert (rule.size_multiple, rule.min_size, rule.frame_stride) == (multiple, min_size, frame_stride)


@pytest.mark.parametrize("tiny,min_steps", [("qwen-image", 2), ("qwen-image-edit", 2), ("ltx2", 2), ("flux", 1),
                                             ("wan2.1-t2v", 1), ("z-image-turbo", 1)])
def test_a_shift_terminal_scheduler_needs_two_steps(tiny, min_steps):
    """diffusers' FlowMatchEuler stretched to `shift_terminal` makes a NaN schedule of one step (its one sigma,
    1, becomes 0 / 0), so a 1-step request would be a NaN image: a 400 naming the knob instead."""
    from vllm_omni.catalog.shapes import scheduler_min_steps
    from vllm_omni.errors import OmniClientError
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

    assert scheduler_min_steps(build_tiny(tiny)) == min_steps
    rule = ShapeRule(min_steps=min_steps)
    rule.check(SP(num_inference_steps=2))
    rule.check(SP())  # the pipeline's default
    if min_steps == 2:
        with pytest.raises(OmniClientError, match="num_inference_steps=1 is fewer") as err:
            rule.check(SP(num_inference_steps=1), prefix="sampling_params_list[0].")
        assert err.value.param == "sampling_params_list[0].num_inference_steps"


def test_a_half_size_knob_doubles_the_multiple():
    """LTX-2's `two_stage` makes the clip at half the size first: 96 is a multiple of 32, and its half is not."""
    from vllm_omni.errors import OmniClientError
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SP

    rule = ShapeRule(size_multiple=32, min_size=32, half_size_knob="two_stage")
    rule.check(SP(width=96, height=64))
    rule.check(SP(width=128, height=64, two_stage=True))
    with pytest.raises(OmniClientError, match="multiple of 64 for this model with two_stage") as err:
        rule.check(SP(width=96, height=64, two_stage=True), size_field="size")
    assert err.value.param == "size"
    with pytest.raises(OmniClientError, match=r"smaller than this model makes with two_stage .* \(64\)"):
        rule.check(SP(width=32, height=64, two_stage=True))


RULE = ShapeRule(size_multiple=16, min_size=16, frame_stride=4)


@pytest.fixture(scope="module")
def img(parser):
    return make_client(parser, FakeOmni(stage_types=["diffusion"], output_modalities={"image"},
                                        input_modalities={"text", "image"}, shape_rules=(RULE,)))


@pytest.fixture(scope="module")
def vid(parser):
    return make_client(parser, FakeOmni(stage_types=["diffusion"], output_modalities={"video"},
                                        shape_rules=(RULE,)))


@pytest.mark.parametrize("path,body,param", [
    ("/v1/images/generations", {"prompt": "a", "size": "65x64"}, "size"),
    ("/v1/images/generations", {"prompt": "a", "size": "64x8"}, "size"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "size": "64x65"}, "size"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "height": 40}, "height"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "sampling_params_list": [{"width": 40}]}, "sampling_params_list[0].width"),
])
def test_image_routes(img, path, body, param):
    seen = len(img.app.state.engine.seen)
    err = assert_client_error(img.post(path, json=body), param)
    assert "16" in err["message"]
    assert len(img.app.state.engine.seen) == seen


def test_edits_form(img):
    files = {"image": ("ok.png", png((64, 64), "RGB"))}
    assert_client_error(img.post("/v1/images/edits", data={"prompt": "x", "size": "65x65"}, files=files), "size")
    assert img.post("/v1/images/edits", data={"prompt": "x", "size": "64x48"}, files=files).status_code == 200


def test_video_routes_create_no_job(vid):
    engine = vid.app.state.engine
    seen = len(engine.seen)
    for path in ("/v1/videos", "/v1/videos/sync"):
        assert_client_error(vid.post(path, json={"prompt": "a", "size": "65x65"}), "size")
        assert_client_error(vid.post(path, data={"prompt": "a", "size": "64x72"}), "size")
    assert len(engine.seen) == seen
    assert vid.get("/v1/videos").json()["data"] == []
    with vid.websocket_connect("/v1/realtime/video") as ws:
        ws.send_text(json.dumps({"type": "session.start", "prompt": "a", "sampling_params": {"size": "65x65"}}))
        msg = ws.receive_json()
        assert (msg["type"], msg["param"]) == ("error", "size"), msg
    assert len(engine.seen) == seen


def test_memory_that_never_fits_is_refused_before_queuing(parser):
    """Admission (issue 13): the stage's budget travels with its rule, so a request whose estimated memory can
    never fit is a 400 naming the field that makes it too big on the route itself."""
    rule = ShapeRule(size_multiple=16, hidden_size=64, text_tokens=16, memory_budget_bytes=16 * 2**20)
    engine = FakeOmni(stage_types=["diffusion"], output_modalities={"image"}, shape_rules=(rule,))
    client = make_client(parser, engine)
    ok = {"prompt": "a", "size": "64x64", "num_inference_steps": 2}
    assert client.post("/v1/images/generations", json=ok).status_code == 200
    assert_client_error(client.post("/v1/images/generations", json={**ok, "n": 4}), "num_outputs_per_prompt")
    err = assert_client_error(client.post("/v1/images/generations", json={**ok, "size": "512x512"}), "size")
    assert "--diffusion-memory-budget-gb" in err["message"]
    assert len(engine.seen) == 1
