"""The torchvision-free Qwen3-Omni processor (qwen3_omni/processing.py): its video processor lays out patches as
the image processor does (a still image is a 2-frame video of itself), pads the last temporal patch by repeating
the last frame, and refuses frame sampling rather than ignoring it."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_omni.models.qwen3_omni.processing import Qwen2VLVideoProcessorPil, has_torchvision, qwen3_omni_processor

pytestmark = pytest.mark.skipif(has_torchvision(), reason="torchvision present: transformers' own video processor")


@pytest.fixture(scope="module")
def processor(tiny_path):
    return qwen3_omni_processor(str(tiny_path))


def frames(count: int, seed: int = 0) -> np.ndarray:
    return (np.random.RandomState(seed).rand(count, 48, 80, 3) * 255).astype(np.uint8)


def test_processor_types(processor):
    """transformers' processor with our video processor in it, and the two agree: a video placeholder in the text
    expands to one token per merged patch of the grid the video processor reports."""
    from transformers import Qwen3OmniMoeProcessor

    assert isinstance(processor, Qwen3OmniMoeProcessor)
    assert isinstance(processor.video_processor, Qwen2VLVideoProcessorPil)
    out = processor(text=[processor.video_token], videos=[frames(2)], return_tensors="np")
    grid = out["video_grid_thw"][0]
    video_id = processor.tokenizer.convert_tokens_to_ids(processor.video_token)
    assert tuple(grid) == (1, 18, 30)  # 2 frames: 1 temporal patch; 48x80 frames resized up to 18x30 patches
    assert (out["input_ids"] == video_id).sum() == grid.prod() // processor.video_processor.merge_size**2


def test_still_video_equals_image(processor):
    frame = frames(1)[0]
    image = processor.image_processor(images=[frame])
    video = processor.video_processor(videos=[np.stack([frame, frame])])
    np.testing.assert_array_equal(video["video_grid_thw"], image["image_grid_thw"])
    np.testing.assert_allclose(video["pixel_values_videos"], image["pixel_values"], rtol=0, atol=1e-6)


def test_odd_frame_count_repeats_last_frame(processor):
    three = frames(3)
    padded = np.concatenate([three, three[-1:]])
    a = processor.video_processor(videos=[three])
    b = processor.video_processor(videos=[padded])
    assert a["video_grid_thw"].tolist() == b["video_grid_thw"].tolist() and a["video_grid_thw"][0, 0] == 2
    np.testing.assert_array_equal(a["pixel_values_videos"], b["pixel_values_videos"])


def test_two_videos_concatenate(processor):
    both = processor.video_processor(videos=[frames(2, 1), frames(4, 2)])
    one = processor.video_processor(videos=[frames(2, 1)])
    assert both["video_grid_thw"][:, 0].tolist() == [1, 2]
    np.testing.assert_array_equal(both["pixel_values_videos"][:len(one["pixel_values_videos"])],
                                  one["pixel_values_videos"])


def test_frame_sampling_is_refused(processor):
    with pytest.raises(ValueError, match="do_sample_frames"):
        processor.video_processor(videos=[frames(4)], do_sample_frames=True)
