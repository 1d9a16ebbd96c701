"""Qwen3-Omni's Hugging Face processor on hosts without torchvision.

transformers' `Qwen3OmniMoeProcessor` loads a `Qwen2VLVideoProcessor`, which is torchvision-only (its base class
resizes with `torchvision.transforms.v2`); CPU hosts here cannot install torchvision, so building the processor
fails even for audio or image input. `qwen3_omni_processor` returns the processor transformers loads whenever
torchvision exists, and otherwise the same processor assembled from the same files with
`Qwen2VLVideoProcessorPil`: the Qwen2-VL video preprocessing (smart resize per frame, rescale, normalize,
temporal patches of `temporal_patch_size` frames) on transformers' PIL image backend. Audio (Whisper features)
and images (transformers' own PIL backend) are unchanged either way.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
from transformers.feature_extraction_utils import BatchFeature
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor
from transformers.processing_utils import VideosKwargs


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


class Qwen2VLVideoProcessorKwargs(VideosKwargs, total=False):
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int


class Qwen2VLVideoProcessorPil(Qwen2VLImageProcessorPil):
    """Qwen2-VL video preprocessing without torchvision: each video's frames are resized with PIL (bicubic) to
    one `smart_resize` size, rescaled, normalized and cut into (temporal x spatial) patches, giving the
    `pixel_values_videos` / `video_grid_thw` layout of transformers' `Qwen2VLVideoProcessor`.

    Frames are taken as given (vLLM's video loader, or the caller, samples them): `do_sample_frames=True` is
    refused rather than ignored."""

    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}  # Qwen2VLVideoProcessor's defaults
    valid_kwargs = Qwen2VLVideoProcessorKwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    _SAMPLING_ONLY = ("fps", "num_frames", "video_metadata", "return_metadata", "min_frames", "max_frames",
                      "cap_pixels_per_frame", "max_video_tokens")

    def __call__(self, videos: Any = None, **kwargs: Any) -> BatchFeature:
        return self.preprocess(videos, **kwargs)

    def preprocess(self, videos: Any, **kwargs: Any) -> BatchFeature:
        if kwargs.pop("do_sample_frames", False):
            raise ValueError("do_sample_frames=True needs torchvision's video processor; pass sampled frames")
        for name in self._SAMPLING_ONLY:  # they only steer frame sampling, which happens before this processor
            kwargs.pop(name, None)
        return_tensors = kwargs.pop("return_tensors", None)
        if not isinstance(videos, list | tuple) or (videos and _is_frame(videos[0])):
            videos = [videos]
        outputs = [super(Qwen2VLVideoProcessorPil, self).preprocess(list(video), **kwargs) for video in videos]
        data = {"pixel_values_videos": np.concatenate([o["pixel_values_videos"] for o in outputs]),
                "video_grid_thw": np.concatenate([o["video_grid_thw"] for o in outputs])}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def _preprocess(self, images: list[np.ndarray], do_resize: bool, size, resample, do_rescale: bool,
                    rescale_factor: float, do_normalize: bool, image_mean, image_std, patch_size: int,
                    temporal_patch_size: int, merge_size: int, **kwargs: Any) -> BatchFeature:
        """`images` are the channels-first frames of one video."""
        frames = []
        for frame in images:
            if do_resize:
                frame = self.resize(frame, size=size, resample=resample, factor=patch_size * merge_size)
            if do_rescale:
                frame = self.rescale(frame, rescale_factor)
            if do_normalize:
                frame = self.normalize(frame, image_mean, image_std)
            frames.append(np.asarray(frame, dtype=np.float32))
        video = np.stack(frames)
        if pad := -len(frames) % temporal_patch_size:  # repeat the last frame, as the torchvision processor does
            video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        num_frames, channels, height, width = video.shape
        grid_t, grid_h, grid_w = num_frames // temporal_patch_size, height // patch_size, width // patch_size
        patches = video.reshape(grid_t, temporal_patch_size, channels, grid_h // merge_size, merge_size, patch_size,
                                grid_w // merge_size, merge_size, patch_size)
        patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(
            grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size)
        return BatchFeature(data={"pixel_values_videos": patches,
                                  "video_grid_thw": np.array([[grid_t, grid_h, grid_w]], dtype=np.int64)})


def _is_frame(item: Any) -> bool:
    """One frame (PIL image or an H x W x C array) rather than one video (a list / T x H x W x C array)."""
    return not isinstance(item, list | tuple) and getattr(item, "ndim", 3) == 3


class Qwen3OmniMoeProcessorPil(Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` holding a `Qwen2VLVideoProcessorPil` (transformers' argument type check only
    knows the torchvision video processor base class)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any):
        if argument_name == "video_processor" and isinstance(argument, Qwen2VLVideoProcessorPil):
            return Qwen2VLVideoProcessorPil
        return super().check_argument_for_proper_class(argument_name, argument)


def qwen3_omni_processor(model: str, tokenizer: Any = None, **kwargs: Any):
    """The checkpoint's `Qwen3OmniMoeProcessor`: transformers' own with torchvision, else the same components
    with `Qwen2VLVideoProcessorPil` as the video processor. `tokenizer` reuses an already loaded one."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.models.whisper.feature_extraction_whisper import WhisperFeatureExtractor

    if tokenizer is not None:
        kwargs["tokenizer"] = tokenizer
    if has_torchvision():
        return AutoProcessor.from_pretrained(model, **kwargs)
    tokenizer = kwargs.pop("tokenizer", None) or AutoTokenizer.from_pretrained(model, **kwargs)
    components = [AutoImageProcessor.from_pretrained(model, **kwargs),
                  Qwen2VLVideoProcessorPil.from_pretrained(model, **kwargs),
                  WhisperFeatureExtractor.from_pretrained(model, **kwargs), tokenizer]
    processor_dict, instantiation_kwargs = Qwen3OmniMoeProcessorPil.get_processor_dict(model, **kwargs)
    return Qwen3OmniMoeProcessorPil.from_args_and_dict(components, processor_dict, **instantiation_kwargs)
