"""Qwen3-Omni through the control plane: `Omni("tiny/qwen3-omni")` runs thinker -> talker -> code2wav as three
stages (two vLLM EngineCore processes and an in-process vocoder) and returns the thinker's text and the
waveform; greedy, both equal transformers' `generate(return_audio=True)` on the same weights, including the
talker's codec frames handed between stages. Two prompts go in one `generate` call, so per-request
conditioning must not leak between the talker's batched rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy

import numpy as np
import pytest
import torch

from vllm_omni.outputs import OmniRequestOutput

from .conftest import chat_prompt_ids, hf_generate, hf_thinker_tokens, media_inputs, media_prompt
from .vocoder_reference import hf_vocoder_chunks

pytestmark = pytest.mark.slow
THINKER_TOKENS = 8
TALKER_TOKENS = 10
PROMPTS = ["Hello! How are you today?", "Describe the image in detail, then answer the question."]


def test_layout(omni):
    assert omni.stage_types == ["llm", "llm", "generation"]
    assert omni.output_modalities == {"text", "audio"}


@pytest.fixture
def talker_frames(omni, monkeypatch) -> dict[str, list]:
    """Codec frames of each finished talker request (by request id), seen on their way to code2wav."""
    talker = omni.engine.stage_clients[1]
    frames: dict[str, list] = {}
    collect = talker.generate

    async def spy(request_id, prompt, params):
        async for out in collect(request_id, prompt, params):
            if out.finished:
                frames[request_id] = out.multimodal_output["stage_data"]["codec_frames"]
            yield out

    monkeypatch.setattr(talker, "generate", spy)
    return frames


def test_text_frames_and_audio_equal_transformers(omni, hf_model, tiny_path, talker_frames):
    from vllm import SamplingParams

    frames_seen = talker_frames
    prompt_ids = [chat_prompt_ids(tiny_path, text)[0].tolist() for text in PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True),
              SamplingParams(max_tokens=TALKER_TOKENS, temperature=0.0), None]
    outputs = omni.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)

    assert [(o.stage_id, o.final_output_type) for o in outputs] == [(0, "text"), (2, "audio")] * len(PROMPTS)
    frames_by_request = [frames_seen[rid] for rid in sorted(frames_seen, key=lambda r: int(r.split("-")[0]))]
    for i, ids in enumerate(prompt_ids):
        text_out, audio_out = outputs[2 * i], outputs[2 * i + 1]
        ref_tokens, ref_frames, _ = hf_generate(hf_model, torch.tensor([ids]), THINKER_TOKENS, TALKER_TOKENS)
        assert text_out.token_ids == ref_tokens
        assert frames_by_request[i] == ref_frames
        assert audio_out.finished and audio_out.multimodal_output["sample_rate"] == 24000
        # transformers' vocoder on the pipeline's chunk schedule (a short first chunk for early audio)
        ref_wav = hf_vocoder_chunks(hf_model, ref_frames)
        np.testing.assert_allclose(audio_out.multimodal_output["audio"], ref_wav, rtol=1e-5, atol=1e-5)
        assert {"stage-0-llm", "stage-1-llm", "stage-2-generation", "e2e"} <= set(audio_out.stage_durations)


def test_engine_threads_after_a_request_with_audio(omni, tiny_path):
    """The engine's threads in this process once a request ran every stage: `Omni`'s loop (the sync API's, as
    vLLM's `LLM` drives its engine) and the vocoder's executor; no orchestrator thread, result router, output
    hand-off or idle start-up thread (the engine runs on its caller's loop, as vLLM's AsyncLLM)."""
    import re
    import threading
    from collections import Counter

    from vllm import SamplingParams

    (ids,) = chat_prompt_ids(tiny_path, PROMPTS[0])[:1]
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6), None]
    outputs = omni.generate([{"prompt_token_ids": ids.tolist()}], params, use_tqdm=False)
    assert outputs[-1].final_output_type == "audio"
    kinds = Counter(re.sub(r"([-_.]?\d+)+$", "", t.name) for t in threading.enumerate())
    print(f"Python thread kinds ({len(kinds)}): {dict(kinds)}")
    engine_made = {k for k in kinds if k.startswith(("Omni", "generation-stage", "stage-", "qwen3"))}
    assert engine_made == {"OmniLoop", "generation-stage"}, kinds


def test_text_only_request_stops_after_the_thinker(omni, tiny_path):
    """`output_modalities=["text"]`: only the thinker runs; its text equals that of a full text + audio run."""
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": chat_prompt_ids(tiny_path, PROMPTS[0])[0].tolist()}
    params = [SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True),
              SamplingParams(max_tokens=TALKER_TOKENS, temperature=0.0), None]
    full = omni.generate([prompt], params, use_tqdm=False)
    text_only = omni.generate([prompt], params, use_tqdm=False, output_modalities=["text"])
    assert [(o.stage_id, o.final_output_type, o.finished) for o in text_only] == [(0, "text", True)]
    assert text_only[0].token_ids == full[0].token_ids
    assert "stage-0-llm" in text_only[0].stage_durations
    assert not any(key.startswith(("stage-1", "stage-2")) for key in text_only[0].stage_durations)


def test_talker_samples_when_asked_and_seeds_reproduce(omni, tiny_path, talker_frames):
    """Talker `SamplingParams(temperature > 0, seed)`: vLLM samples codebook 0 and the code predictor the others;
    the same seed gives the same frames, another seed or greedy decoding other frames."""
    from vllm import SamplingParams

    frames = talker_frames
    prompt = {"prompt_token_ids": chat_prompt_ids(tiny_path, PROMPTS[0])[0].tolist()}
    thinker = SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True)

    def run(talker_params):
        frames.clear()
        outputs = omni.generate([prompt], [thinker, talker_params, None], use_tqdm=False)
        assert outputs[-1].finished and outputs[-1].final_output_type == "audio"
        (got,) = frames.values()
        return got

    sampled = [run(SamplingParams(max_tokens=TALKER_TOKENS, temperature=0.9, top_k=50, seed=seed))
               for seed in (7, 7, 8)]
    greedy = run(SamplingParams(max_tokens=TALKER_TOKENS, temperature=0.0))
    assert sampled[0] == sampled[1]
    assert sampled[0] != sampled[2] and sampled[0] != greedy
    assert {len(frame) for frame in sampled[0]} == {len(greedy[0])}  # every frame has all its codebooks
    # No talker params: the stage default, transformers' sampling (temperature 0.9, top-k 50, penalty 1.05).
    assert omni.default_sampling_params_list[1].temperature == 0.9


@pytest.mark.parametrize("use_audio_in_video", [False, True], ids=["audio+image", "video+audio_in_video"])
def test_media_input_thinker_tokens_equal_transformers(omni, hf_model, tiny_path, use_audio_in_video):
    """Audio + image, and video with its audio track (`use_audio_in_video`), through vLLM's thinker and its
    multimodal processor (torchvision-free here): greedy text tokens equal transformers' `generate`."""
    from vllm import SamplingParams

    audio, image, video = media_inputs()
    if use_audio_in_video:
        prompt = media_prompt(tiny_path, ["video"], "What happens?")
        media = {"video": video, "audio": (audio, 16000)}
        reference = {"videos": [video], "audio": [audio]}
    else:
        prompt = media_prompt(tiny_path, ["audio", "image"], "What is this?")
        media = {"audio": (audio, 16000), "image": image}
        reference = {"audio": [audio], "images": [image]}
    request = {"prompt": prompt, "multi_modal_data": media,
               "mm_processor_kwargs": {"use_audio_in_video": use_audio_in_video}}
    params = [SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True), None, None]
    (out,) = omni.generate([request], params, use_tqdm=False, output_modalities=["text"])
    assert out.stage_id == 0 and out.finished
    assert out.token_ids == hf_thinker_tokens(hf_model, tiny_path, prompt, THINKER_TOKENS,
                                              use_audio_in_video=use_audio_in_video, **reference)


@pytest.mark.parametrize("use_audio_in_video", [False, True], ids=["audio+image", "video+audio_in_video"])
def test_media_input_speech_equals_transformers(omni, hf_model, tiny_path, talker_frames, monkeypatch,
                                                use_audio_in_video):
    """Audio + image, and video with its audio track (`use_audio_in_video`), in, speech out: the talker takes the
    thinker's `accept_hidden_layer` states at the multimodal positions (exported by the thinker stage's connector)
    and M-RoPE positions; greedy, the codec frames equal transformers' `generate(return_audio=True)` and the
    waveform transformers' vocoder on the pipeline's chunk schedule."""
    from vllm import SamplingParams

    from vllm_omni.models.qwen3_omni.processing import qwen3_omni_processor

    audio, image, video = media_inputs()
    if use_audio_in_video:
        prompt = media_prompt(tiny_path, ["video"], "What happens?")
        request = {"prompt": prompt, "multi_modal_data": {"video": video, "audio": (audio, 16000)},
                   "mm_processor_kwargs": {"use_audio_in_video": True}}
        reference = {"videos": [video], "audio": [audio], "use_audio_in_video": True}
    else:
        prompt = media_prompt(tiny_path, ["audio", "image"], "What is this?")
        request = {"prompt": prompt, "multi_modal_data": {"audio": (audio, 16000), "image": image}}
        reference = {"audio": [audio], "images": [image]}
    params = [SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True),
              SamplingParams(max_tokens=TALKER_TOKENS, temperature=0.0), None]
    text_out, audio_out = omni.generate([request], params, use_tqdm=False)

    inputs = qwen3_omni_processor(str(tiny_path))(text=prompt, return_tensors="pt", **reference)
    seen = {}
    chunked_decode = hf_model.code2wav.chunked_decode

    def record_codes(codes, **kwargs):
        seen["frames"] = codes[0].T.tolist()
        return chunked_decode(codes, **kwargs)

    # transformers' talker M-RoPE reads the audio encoder's `n_window` from its own config, which has no
    # `audio_config` (an AttributeError for audio with image / video input): lend it the thinker's.
    monkeypatch.setattr(hf_model.talker.config, "audio_config", hf_model.config.thinker_config.audio_config,
                        raising=False)
    # transformers' `generate` hands `use_audio_in_video` to the thinker only, so its talker would lay out the
    # interleaved video / audio positions as one audio then text; ours keeps the thinker's layout, which is
    # transformers' talker given the flag (`talker_use_audio_in_video`; see test_talker_mrope_positions_equal_
    # transformers). On the tiny checkpoint the greedy frames are the same either way.
    talker_flag = {"talker_use_audio_in_video": True} if use_audio_in_video else {}
    hf_model.code2wav.chunked_decode = record_codes
    try:
        sequences, _ = hf_model.generate(
            **inputs, thinker_max_new_tokens=THINKER_TOKENS, thinker_do_sample=False, thinker_eos_token_id=None,
            talker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS, talker_repetition_penalty=1.0,
            return_audio=True, use_audio_in_video=use_audio_in_video, **talker_flag)
    finally:
        del hf_model.code2wav.chunked_decode
    assert text_out.token_ids == sequences[0, inputs["input_ids"].shape[1]:].tolist()
    (frames,) = talker_frames.values()  # the fixture is per test case: only this request's talker ran
    assert frames == seen["frames"]
    # transformers' `chunked_decode` is one 300-frame chunk; the pipeline's vocoder runs its chunk schedule (a
    # short first chunk for early audio), which is transformers' `Code2Wav` on those chunks.
    np.testing.assert_allclose(audio_out.multimodal_output["audio"], hf_vocoder_chunks(hf_model, seen["frames"]),
                               rtol=1e-5, atol=1e-5)


def test_thinker_text_outlives_a_talker_done_first(omni, tiny_path, monkeypatch):
    """A talker that stops first (its `max_tokens`) ends the audio, not the request: the thinker's text still
    comes whole, and only the stream's last output, once every stage is done, is marked finished. The thinker
    waits at its first output of 32+ tokens (handed on: the talker has its 8 frames' worth) until the whole audio
    is out, so the talker finishes first on any machine."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    prompt = {"prompt_token_ids": chat_prompt_ids(tiny_path, PROMPTS[0])[0].tolist()}
    thinker = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    params = [thinker, SamplingParams(max_tokens=8, temperature=0.0), None]
    (text_only,) = omni.generate([prompt], params, use_tqdm=False, output_modalities=["text"])
    assert len(text_only.token_ids) == 64

    audio_done = asyncio.Event()
    thinker_client, add_request = omni.engine.stage_clients[0], omni.engine.add_request
    thinker_generate = thinker_client.generate

    async def thinker_ends_last(request_id, prompt, params):
        held = False
        async for out in thinker_generate(request_id, prompt, params):
            if out.finished and not held:  # a loaded machine's burst skipped 32: hold the last output instead
                held = await hold()
            yield out
            if not held and len(out.token_ids) >= 32:
                held = await hold()

    talker_first = []

    async def hold() -> bool:
        with contextlib.suppress(TimeoutError):  # the talker got too few tokens to stop without the thinker's end
            await asyncio.wait_for(audio_done.wait(), 60)
        talker_first.append(audio_done.is_set())
        return True

    def add_watched(request_id, prompt, params, sink, *args, **kwargs):
        def watch(item):
            if isinstance(item, OmniRequestOutput) and "audio" in item.multimodal_output:  # the whole waveform
                audio_done.set()
            sink(item)

        add_request(request_id, prompt, params, watch, *args, **kwargs)

    monkeypatch.setattr(thinker_client, "generate", thinker_ends_last)
    monkeypatch.setattr(omni.engine, "add_request", add_watched)
    text_out, audio_out = omni.generate([prompt], params, use_tqdm=False)
    assert (text_out.stage_id, audio_out.final_output_type) == (0, "audio")
    assert text_out.token_ids == text_only.token_ids and text_out.finished and audio_out.finished

    async def stream() -> list:
        """Every output of one streamed request, as `AsyncOmni.generate` reads them (it stops at `finished`)."""
        audio_done.clear()
        outputs: asyncio.Queue = asyncio.Queue()
        cumulative = copy.copy(thinker)
        cumulative.output_kind = RequestOutputKind.CUMULATIVE
        omni.engine.add_request("talker-first", prompt, [cumulative, *params[1:]], outputs.put_nowait)
        items = [await outputs.get()]
        while not getattr(items[-1], "finished", True):
            items.append(await outputs.get())
        await asyncio.sleep(1.0)  # nothing may follow the finished output
        return items + [outputs.get_nowait() for _ in range(outputs.qsize())]

    items = omni.run_in_loop(stream()).result(timeout=300)
    assert all(isinstance(o, OmniRequestOutput) for o in items)
    assert [o.finished for o in items] == [False] * (len(items) - 1) + [True]
    assert [o for o in items if o.stage_id == 0][-1].token_ids == text_only.token_ids
    if talker_first[-1]:
        assert items[-1].stage_id == 0, "the audio ended first, yet the stream ended with it"
    audio_last = [o for o in items if o.stage_id == 2][-1]  # the whole audio, out before the text's end
    assert "audio" in audio_last.multimodal_output and audio_last.stage_finished
    assert items[-1].stage_durations.keys() >= {"stage-0-llm", "stage-1-llm", "stage-2-generation", "e2e"}
