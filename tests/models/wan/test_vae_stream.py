"""The streaming Wan VAE decode: chunk by chunk equals diffusers' whole-clip decode, and rows can leave midway.

Why it matters: streaming sends frames decoded chunk by chunk, which must be the frames a full decode gives; an
aborted request's rows are dropped between chunks (with the VAE's causal cache) and the others decode on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.video_utils import to_uint8_frames
from vllm_omni.models.wan.vae_stream import WanVaeStream


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKLWan

    from vllm_omni.catalog.tiny import build_tiny

    return AutoencoderKLWan.from_pretrained(build_tiny("wan2.1-t2v") / "vae", dtype=torch.float32).eval()


def test_chunked_wan_vae_decode_equals_full_decode(vae):
    latents = torch.randn(2, 16, 4, 4, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), WanVaeStream(vae, latents, chunk_latent_frames=1) as stream:
        full = vae.decode(latents).sample
        chunks = list(stream)
    # First latent frame -> 1 video frame, each later one -> 4 (the causal temporal stride).
    assert [c.shape[2] for c in chunks] == [1, 4, 4, 4]
    torch.testing.assert_close(torch.cat(chunks, dim=2), full, rtol=0, atol=1e-6)
    frames = to_uint8_frames(full)
    assert frames.shape == (2, 13, 32, 48, 3) and frames.dtype == np.uint8
    with pytest.raises(ValueError, match="chunk_latent_frames"):
        WanVaeStream(vae, latents, chunk_latent_frames=0)


def test_rows_dropped_between_chunks_leave_the_others_unchanged(vae):
    latents = torch.randn(3, 16, 4, 4, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = vae.decode(latents[[0, 2]]).sample
        with WanVaeStream(vae, latents) as stream:
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 2:  # the middle row's request was aborted after two chunks
                    rows = torch.tensor([0, 2])
                    stream.keep_rows(rows)
                    chunks = [c.index_select(0, rows) for c in chunks]
    assert [c.shape[0] for c in chunks] == [2, 2, 2, 2]
    torch.testing.assert_close(torch.cat(chunks, dim=2), expected, rtol=0, atol=1e-5)
