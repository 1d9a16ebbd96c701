"""Video helpers: MP4 round trip through PyAV, and streamed clips joined back from their chunks.

Why it matters: the API returns MP4 built by `encode_mp4` (frame count and size must survive), and a streamed
clip's final output is rebuilt from its chunks, which must give exactly the clip (the streaming Wan VAE decode
itself is pinned in tests/models/wan/test_vae_stream.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_omni.diffusion.video_utils import (
    STREAMED_FRAMES,
    FragmentedMp4Writer,
    decode_mp4,
    decode_mp4_audio,
    encode_mp4,
    join_streamed_video,
)


def _frames(t: int, h: int, w: int) -> np.ndarray:
    ramp = np.linspace(0, 255, t * h * w * 3).reshape(t, h, w, 3)
    return ramp.astype(np.uint8)


@pytest.mark.parametrize("fragmented", [False, True])
def test_mp4_round_trip_keeps_frame_count_and_size(fragmented):
    frames = _frames(9, 32, 48)
    data = encode_mp4(frames, fps=16, fragmented=fragmented)
    assert data[4:8] == b"ftyp"
    decoded = decode_mp4(data)
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(int) - frames.astype(int)).mean() < 8  # lossy H.264, crf 18


def test_mp4_pads_odd_sizes_and_rejects_bad_input():
    assert decode_mp4(encode_mp4(_frames(3, 17, 23), fps=8)).shape == (3, 18, 24, 3)
    with pytest.raises(ValueError, match="uint8"):
        encode_mp4(np.zeros((3, 8, 8, 3), dtype=np.float32), fps=8)
    with pytest.raises(ValueError, match="fps"):
        encode_mp4(_frames(3, 8, 8), fps=0)


def test_fragmented_writer_streams_one_playable_mp4():
    """Each write returns the fragments finished so far (one chunk behind); the pieces make the whole clip."""
    from vllm_omni.diffusion.video_utils import FragmentedMp4Writer, split_fmp4

    clip = np.stack([np.full((32, 48, 3), 10 * i, np.uint8) for i in range(13)])
    writer = FragmentedMp4Writer(16, 48, 32)
    pieces, flushed = [], []
    for start, size in ((0, 1), (1, 4), (5, 4), (9, 4)):
        pieces.append(writer.write(clip[start:start + size]))
        flushed.append(writer.frames_flushed)
    pieces.append(writer.close())
    assert flushed == [0, 1, 5, 9] and writer.frames_flushed == 13
    init, fragments = split_fmp4(pieces[0])
    assert init and not fragments  # the first chunk's fragment is still open: only the init segment so far
    frames = decode_mp4(b"".join(pieces))
    assert frames.shape == clip.shape and np.abs(frames.astype(int) - clip).max() <= 3


def test_streamed_video_is_joined_from_its_chunks_or_fails_when_one_is_missing():
    clip = _frames(9, 4, 6)
    chunks = [clip[:1], clip[1:5], clip[5:]]
    joined = join_streamed_video({STREAMED_FRAMES: 9, "fps": 16}, chunks)
    assert joined.keys() == {"video", "fps"} and np.array_equal(joined["video"], clip)
    rows = [np.stack([c, c]) for c in chunks]  # num_outputs_per_prompt > 1: (n, t, H, W, 3) chunks
    assert np.array_equal(join_streamed_video({STREAMED_FRAMES: 9}, rows)["video"], np.stack([clip, clip]))
    plain = {"video": clip, "fps": 16}
    assert join_streamed_video(plain, []) is plain
    with pytest.raises(RuntimeError, match="5 of its 9 frames"):
        join_streamed_video({STREAMED_FRAMES: 9}, chunks[:2])


def test_soundtrack_is_muxed_losslessly_whole_and_in_fragments():
    """LTX-2's clips carry a waveform: the MP4's FLAC track decodes to it at 16-bit (whole file, fragmented
    file, and fragment by fragment with each chunk's samples); a silent clip has no audio track."""
    frames = _frames(9, 32, 48)
    t = np.linspace(0, 1, 6000, dtype=np.float32)
    wave = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.25 * np.sin(2 * np.pi * 220 * t)])
    for fragmented in (False, True):
        data = encode_mp4(frames, 24, audio=wave, sample_rate=16000, fragmented=fragmented)
        audio, rate = decode_mp4_audio(data)
        assert decode_mp4(data).shape == frames.shape and rate == 16000 and audio.shape == wave.shape
        assert np.abs(audio - wave).max() <= 1 / 32767
    writer = FragmentedMp4Writer(24, 48, 32, sample_rate=16000, channels=2)
    data = writer.write(frames[:4], wave[:, :2666]) + writer.write(frames[4:], wave[:, 2666:]) + writer.close()
    audio, _ = decode_mp4_audio(data)
    assert decode_mp4(data).shape == frames.shape and np.abs(audio - wave).max() <= 1 / 32767
    assert decode_mp4_audio(encode_mp4(frames, 24)) is None
    with pytest.raises(ValueError, match="sample_rate"):
        encode_mp4(frames, 24, audio=wave)

