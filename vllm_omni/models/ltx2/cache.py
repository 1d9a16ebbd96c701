"""LTX-2's cache presets (docs/cache.md): TeaCache's rescale polynomial as published for LTX-Video
(TeaCache4LTX-Video), the nearest calibrated relative; the probe is the video timestep embedding."""

from vllm_omni.diffusion.cache.policy import FamilyPresets

PRESETS = FamilyPresets(coefficients=(2.14700694e1, -1.28016453e1, 2.31279151e0, 7.92487521e-1, 9.69274326e-3))
