"""Our LTX-2 DiT vs diffusers' `LTX2VideoTransformer3DModel` on the same weights and inputs (fp32).

Why it matters: the pipeline-level PSNR/SNR bars could hide a small error in one branch (the audio-video
cross-attention, per-token timesteps, the text mask) behind the VAE; this pins the joint forward itself, with both
RoPE layouts (`split`, the tiny checkpoint's and the real repo's, and `interleaved`), padded text and per-token
(image-to-video) timesteps, and the loader's name mapping (every checkpoint tensor has its parameter).
"""

from __future__ import annotations

import json

import pytest
import torch

VIDEO_SHAPE, AUDIO_FRAMES, FPS, TEXT = (3, 4, 6), 7, 24.0, 10


def _ours(model_dir):
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.model_loader.components import load_native_transformer
    from vllm_omni.models.ltx2.transformer import LTX2VideoTransformer3DModel

    od_config = OmniDiffusionConfig(model=str(model_dir))
    return load_native_transformer(LTX2VideoTransformer3DModel, model_dir, "transformer", od_config,
                                   torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module", params=["split", "interleaved"])
def models(request, dist_world, ltx2_dir, tmp_path_factory):
    from diffusers import LTX2VideoTransformer3DModel

    model_dir = ltx2_dir
    if request.param == "interleaved":  # the tiny DiT's weights under the other RoPE layout
        model_dir = tmp_path_factory.mktemp("ltx2-interleaved")
        config = json.loads((ltx2_dir / "transformer" / "config.json").read_text())
        config["rope_type"] = "interleaved"
        ref = LTX2VideoTransformer3DModel.from_config(config)
        ref.load_state_dict(LTX2VideoTransformer3DModel.from_pretrained(ltx2_dir / "transformer").state_dict())
        ref.save_pretrained(model_dir / "transformer")
    ref = LTX2VideoTransformer3DModel.from_pretrained(model_dir / "transformer", torch_dtype=torch.float32).eval()
    return _ours(model_dir), ref


def _inputs(ours, video_timestep: bool, padded: bool):
    cfg = ours.config
    gen = torch.Generator().manual_seed(0)
    tokens = VIDEO_SHAPE[0] * VIDEO_SHAPE[1] * VIDEO_SHAPE[2]
    video = torch.randn(2, tokens, cfg.in_channels, generator=gen)
    audio = torch.randn(2, AUDIO_FRAMES, cfg.audio_in_channels, generator=gen)
    text = torch.randn(2, TEXT, cfg.caption_channels, generator=gen)
    audio_text = torch.randn(2, TEXT, cfg.caption_channels, generator=gen)
    mask = torch.ones(2, TEXT, dtype=torch.long)
    if padded:
        mask[1, :4] = 0  # left padding, as the pipeline's tokenizer pads
    timestep = torch.tensor([900.0, 350.0])
    per_token = None
    if video_timestep:  # image-to-video: the first latent frame is clean
        per_token = timestep[:, None].repeat(1, tokens)
        per_token[:, : VIDEO_SHAPE[1] * VIDEO_SHAPE[2]] = 0
    return video, audio, text, audio_text, mask, timestep, per_token


@pytest.mark.parametrize("video_timestep,padded", [(False, False), (True, True)])
def test_forward_matches_diffusers(models, video_timestep, padded):
    ours, ref = models
    video, audio, text, audio_text, mask, timestep, per_token = _inputs(ours, video_timestep, padded)
    with torch.no_grad():
        expected_video, expected_audio = ref(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text,
            audio_encoder_hidden_states=audio_text, timestep=timestep if per_token is None else per_token,
            audio_timestep=timestep, sigma=timestep, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=VIDEO_SHAPE[0], height=VIDEO_SHAPE[1], width=VIDEO_SHAPE[2], fps=FPS,
            audio_num_frames=AUDIO_FRAMES, use_cross_timestep=True, return_dict=False,
        )
        flat = ours(torch.cat([video.flatten(1), audio.flatten(1)], dim=1), timestep, text, audio_text, mask,
                    video_timestep=per_token, video_shape=VIDEO_SHAPE, audio_frames=AUDIO_FRAMES, fps=FPS)
    split = expected_video[0].numel()
    got_video, got_audio = flat[:, :split].view_as(expected_video), flat[:, split:].view_as(expected_audio)
    assert expected_video.abs().mean() > 0.1 and expected_audio.abs().mean() > 0.1, "a zero output proves nothing"
    torch.testing.assert_close(got_video, expected_video, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_audio, expected_audio, rtol=1e-5, atol=1e-5)


def test_parameters_are_diffusers_names(models):
    ours, ref = models
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in ref.named_parameters()}
